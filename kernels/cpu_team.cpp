// The held team (cpu_kernels.h's QrunTeam) as the tests drive it: which thread ran each item of a claimed loop.

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
