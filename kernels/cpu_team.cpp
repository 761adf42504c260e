// The held team (cpu_kernels.h's QrunTeam) as the tests drive it: which thread ran each item of a claimed loop, and
// which threads warmed ahead of a job.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"

// Items [0, count) claimed (qrun_parallel_claims) by a team of `threads` held for the call, the holding thread
// spending `holder_spin_ns` on each item it runs: ran[i] is the team part that ran item i, -2 where more than one did.
extern "C" void qrun_team_claims(int64_t count, int threads, int64_t holder_spin_ns, int64_t* ran) {
    std::vector<std::atomic<int64_t>> runs(count);
    for (auto& run : runs) run.store(-1, std::memory_order_relaxed);
    QrunTeam::hold(threads, [&] {
        qrun_parallel_claims(count, threads, [&runs, holder_spin_ns](int64_t first, int64_t last) {
            const int64_t part = omp_get_thread_num();  // the team's threads are its region's, numbered as its parts
            for (int64_t item = first; item < last; item++) {
                if (part == 0) {
                    const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(holder_spin_ns);
                    while (std::chrono::steady_clock::now() < until) {
                    }
                }
                int64_t none = -1;
                if (!runs[item].compare_exchange_strong(none, part)) runs[item].store(-2);
            }
        });
    });
    for (int64_t item = 0; item < count; item++) ran[item] = runs[item].load();
}

// A team of `threads` held for the call: a job, two warms posted after it (the second to be ignored), then, once each
// other thread is warming (or 2 s passed), a job that ends the warm, and a last job. warmed[p]: 1 for each first warm
// thread p ran, 100 for each second; stopped[p]: 1 where its warm ended because the job came.
extern "C" void qrun_team_warm(int threads, int64_t* warmed, int64_t* stopped) {
    std::vector<std::atomic<int64_t>> runs(threads), ends(threads);
    for (int p = 0; p < threads; p++) runs[p] = ends[p] = 0;
    const auto deadline = [] { return std::chrono::steady_clock::now() + std::chrono::seconds(2); };
    QrunTeam::hold(threads, [&] {
        QrunTeam* team = QrunTeam::held();
        if (!team) return;  // one thread: nothing is held
        const auto nothing = [](int, int) {};
        team->run(team->size(), nothing);
        for (int64_t weight : {1, 100}) {
            std::atomic<int64_t>*runs_at = runs.data(), *ends_at = ends.data();
            team->warm([runs_at, ends_at, weight](int part, int, const QrunTeam::Waiting& waiting) {
                runs_at[part] += weight;
                for (const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
                     waiting() && std::chrono::steady_clock::now() < until;) {
                }
                ends_at[part] = waiting() ? 0 : 1;
            });
        }
        for (const auto until = deadline(); std::chrono::steady_clock::now() < until;) {
            bool all = true;
            for (int p = 1; p < team->size(); p++) all &= runs[p].load() != 0;
            if (all) break;
        }
        team->run(team->size(), nothing);
        team->run(team->size(), nothing);
    });
    for (int p = 0; p < threads; p++) {
        warmed[p] = runs[p].load();
        stopped[p] = ends[p].load();
    }
}
