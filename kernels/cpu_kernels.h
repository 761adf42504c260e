// The plain C++ kernels' entry points (cpu_activation.cpp, cpu_argmax.cpp, cpu_attention.cpp, cpu_draw.cpp,
// cpu_half_gemv.cpp, cpu_int4.cpp, cpu_kv_store.cpp, cpu_logprobs.cpp, cpu_norm.cpp, cpu_quant_matmul.cpp,
// cpu_quant_matmul_amx.cpp, cpu_rotation.cpp, cpu_team.cpp, cpu_token_bitmask.cpp), for cpu_ops.cpp, which makes them
// torch ops (the C++ model calls those); their Python modules document the arguments. And what
// the kernels share: the bfloat16 rounding, e^x, 16-float vectors, how a loop splits over the threads (a
// step's team, else an OpenMP region).

#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <type_traits>

#include "cpu_quant_planes.h"

// bfloat16 bits of a float, rounded to nearest even as torch rounds; NaN stays NaN. Branch-free, so loops of it
// vectorise.
inline uint16_t qrun_bfloat16_bits(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    const uint16_t rounded = uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
    return (bits & 0x7FFFFFFF) > 0x7F800000 ? uint16_t(0x7FC0) : rounded;
}

// The element kinds of the float kernels' rows (their `kind` arguments, as cpu_ops.cpp passes them).
enum qrun_kind : int { QRUN_F32 = 0, QRUN_BF16 = 1 };

// f(std::integral_constant<int, kind>) for a kernel's runtime kind: 0 once it ran, 1 for an unknown kind.
template <typename F>
inline int qrun_with_kind(int kind, const F& f) {
    if (kind == QRUN_F32)
        f(std::integral_constant<int, QRUN_F32>{});
    else if (kind == QRUN_BF16)
        f(std::integral_constant<int, QRUN_BF16>{});
    else
        return 1;
    return 0;
}

// A step's threads held as one team from its first op to its last: the calling thread runs the step, the
// others wait in a spin loop for each kernel's share. Handing a share over costs a cache line's round trip between the
// cores (~0.06 us on one core complex of a 2-core EPYC VM, ~0.35 us across two), against ~1.1-1.6 us for a libgomp
// region across two; a step at batch 1 enters ~150. Over SmolLM2's 30 layers of 4-bit products at one row (a C++
// harness, weights from memory, two threads across complexes): 1.31-1.35 ms a step against 1.46-1.54 ms in a region
// each; the engine's 4.0-bpw single stream 1.07x (issue 15's notes). Only the kernels that split through
// qrun_parallel or qrun_parallel_claims use the team; a region entered while it is held runs on one thread, and a
// worksharing construct (`omp for`, `omp barrier`) reached on the holding thread alone would wait for the others
// forever: what a held step calls must split through those two only.
class QrunTeam {
  public:
    // step() on the calling thread with a team of `threads` held for it (none at one thread, or when one is held
    // already); an exception it throws is rethrown once the team is released.
    template <typename Step>
    static void hold(int threads, const Step& step) {
        if (threads <= 1 || held()) return step();
        QrunTeam team;
        std::exception_ptr error;
#pragma omp parallel num_threads(threads)
        {
            if (omp_get_thread_num() == 0) {
                team.size_ = omp_get_num_threads();
                team.claims_ = claims_for(team.size_);
                held() = &team;
                try {
                    step();
                } catch (...) {
                    error = std::current_exception();
                }
                held() = nullptr;
                team.post(nullptr, nullptr, 0);
            } else {
                team.serve(omp_get_thread_num());
            }
        }
        if (error) std::rethrow_exception(error);
    }

    // The team the calling thread holds, or null.
    static QrunTeam*& held() {
        thread_local QrunTeam* team = nullptr;
        return team;
    }

    int size() const { return size_; }

    // body(part, parts) on the first `parts` (at most size()) threads, the holder's part 0; returns when all are done.
    // The others run a copy of the body on their own stack: the body's own lies on the holder's, in a line that its
    // calls below may write (return addresses, spills) while the others read their captures from it again and again,
    // each time a trip between the cores (C++ steps of a 4.0-bpw SmolLM2 on a 2-core Xeon, against reading it in
    // place, alternating in one process: one row of 200 tokens 1.08-1.11x over four runs, of 1,000 1.11x, two rows of
    // 300 1.10x, 4 rows 1.00x; the dense bfloat16 model at one row 1.02x: one-off probes). For the same reason a body
    // captures by value what it reads again and again (its references lead back to the holder's stack): the VNNI
    // kernel's tile loop at one row 1.02x and 1.04x, the decode attention's 0.99-1.02x.
    template <typename Body>
    void run(int parts, const Body& body) {
        post(
            [](const void* b, int part, int n) {
                if constexpr (std::is_copy_constructible_v<Body>) {
                    const Body copy = *static_cast<const Body*>(b);
                    copy(part, n);
                } else {
                    (*static_cast<const Body*>(b))(part, n);
                }
            },
            &body, parts);
        std::exception_ptr error;  // rethrown once the others are done with the body
        try {
            body(0, parts);
        } catch (...) {
            error = std::current_exception();
        }
        while (working_.value.load(std::memory_order_acquire) != 0) pause();
        if (error) std::rethrow_exception(error);
    }

    // body(first, last) over [0, count) (below 2^32), every item once, on the first `parts` (at most size())
    // threads; returns when all are done. Each thread claims its own equal run from the front, in chunks that shrink
    // as it runs out (GUIDE), then takes half of what is left of another's from its back as a run of its own, which
    // the others may take from in turn. With fixed halves the faster thread waited for the other at the end of every
    // product, by turns (a 4.0-bpw SmolLM2's single stream on a 2-core Zen 3 EPYC, alternating with fixed halves in
    // one process, 16 pairs a run: 1.02-1.05x over four runs; one-off probes). A claim from its own run is an atomic
    // on a line the thread alone touches until a taker comes.
    template <typename Body>
    void run_claims(int parts, int64_t count, const Body& body) {
        for (int part = 0; part < parts; part++)
            claims_[part].range.store(Claims::pack(count * part / parts, count * (part + 1) / parts),
                                      std::memory_order_relaxed);
        run(parts, [this, body](int part, int parts) { claim(part, parts, body); });
    }

    // warm(part, parts, waiting) once on each of the other threads (parts 1 ..) while it waits for the next job: it
    // fetches into that core's caches what the thread reads first in that job, and returns soon after waiting()
    // turns false. Between products the others wait while the holder alone runs the step's serial work (norms,
    // rotations, the inputs' quantization: ~10% of a 4.0-bpw SmolLM2's single-stream step on a 2-core Zen 3 EPYC),
    // and the memory bus idles; with the next product's first tiles warmed meanwhile, the stream ran 1.032x and
    // 1.048x (medians of 24 and 16 pairs against no warming, alternating in one process; one-off probes). `warm` is
    // copied into the team (trivially copyable and small); the first warm between two jobs counts, a later one is
    // ignored.
    template <typename Warm>
    void warm(const Warm& warm) {
        static_assert(std::is_trivially_copyable_v<Warm> && sizeof(Warm) <= sizeof(warm_.state));
        if (job_.warmed) return;
        job_.warmed = true;
        new (warm_.state) Warm(warm);
        warm_.call = [](const void* state, int part, int parts, const Waiting& waiting) {
            (*std::launder(static_cast<const Warm*>(state)))(part, parts, waiting);
        };
        warm_.posted.fetch_add(1, std::memory_order_release);
    }

    // Whether the thread that warms is still waiting for its next job.
    class Waiting {
      public:
        Waiting(const std::atomic<int64_t>& posted, int64_t seen) : posted_(posted), seen_(seen) {}
        bool operator()() const { return posted_.load(std::memory_order_relaxed) == seen_; }

      private:
        const std::atomic<int64_t>& posted_;
        int64_t seen_;
    };

  private:
    // A claim takes this share of what its run had left, so the last claims are single items.
    static constexpr int64_t GUIDE = 4;

    // What is left of a thread's run: [front, back) in one word, so a claim from either end sees the other's.
    struct alignas(64) Claims {
        std::atomic<uint64_t> range{0};
        static uint64_t pack(int64_t front, int64_t back) { return uint64_t(back) << 32 | uint64_t(front); }
        static int64_t front(uint64_t range) { return int64_t(range & 0xFFFFFFFF); }
        static int64_t back(uint64_t range) { return int64_t(range >> 32); }
    };

    // The holding thread's claims, one per team thread, kept from hold to hold: a step holds the team once, and
    // allocates nothing. Their ranges are written by run_claims before each use.
    static Claims* claims_for(int size) {
        thread_local std::unique_ptr<Claims[]> claims;
        thread_local int capacity = 0;
        if (capacity < size) {
            claims.reset(new Claims[size]);
            capacity = size;
        }
        return claims.get();
    }

    template <typename Body>
    void claim(int part, int parts, const Body& body) {
        std::atomic<uint64_t>& mine = claims_[part].range;
        uint64_t range = mine.load(std::memory_order_relaxed);
        for (;;) {
            // the front only grows (a claim may pass the back: nothing left), until a taking refills the run
            for (int64_t chunk = std::max<int64_t>(1, (Claims::back(range) - Claims::front(range)) / GUIDE);;) {
                range = mine.fetch_add(chunk, std::memory_order_relaxed);
                const int64_t front = Claims::front(range), back = Claims::back(range);
                if (front >= back) break;
                const int64_t last = std::min(front + chunk, back);
                chunk = std::max<int64_t>(1, (back - last) / GUIDE);
                body(front, last);
            }
            if (!take(part, parts, range)) return;
            mine.store(range, std::memory_order_relaxed);
        }
    }

    // Half of what is left of another thread's run, taken from its back into `range`; false: nothing is left.
    bool take(int part, int parts, uint64_t& range) {
        for (int other = 1; other < parts; other++) {
            std::atomic<uint64_t>& theirs = claims_[(part + other) % parts].range;
            uint64_t left = theirs.load(std::memory_order_relaxed);
            for (;;) {
                const int64_t front = Claims::front(left), back = Claims::back(left);
                if (front >= back) break;
                const int64_t taken = back - std::max<int64_t>(1, (back - front) / 2);
                if (theirs.compare_exchange_weak(left, Claims::pack(front, taken), std::memory_order_relaxed)) {
                    range = Claims::pack(taken, back);
                    return true;
                }
            }
        }
        return false;
    }

    using Call = void (*)(const void* body, int part, int parts);
    // A job as the waiting threads read it: its count, which they watch, and what to run, in one cache line, so a
    // hand-over brings them one line from the holder's core, not the count's and then the call's (C++ steps as above:
    // one row of 200 tokens 1.01x and 1.02x, 4 rows of 300 1.01x).
    struct alignas(64) Job {
        std::atomic<int64_t> posted{0};
        Call call = nullptr;
        const void* body = nullptr;
        int parts = 0;
        bool warmed = false;  // the holder's: whether a warm was posted since this job (in the line post writes)
    };
    struct alignas(64) Counter {
        std::atomic<int64_t> value{0};
    };

    static void pause() {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }

    using WarmCall = void (*)(const void* state, int part, int parts, const Waiting& waiting);
    // A warm as the waiting threads read it: its count, which they watch beside the job's, and what to run.
    struct alignas(64) Warm {
        std::atomic<int64_t> posted{0};
        WarmCall call = nullptr;
        alignas(16) unsigned char state[192];
    };

    // The next job for the waiting threads (call null: leave).
    void post(Call call, const void* body, int parts) {
        job_.warmed = false;
        job_.call = call;
        job_.body = body;
        job_.parts = parts;
        working_.value.store(size_ - 1, std::memory_order_relaxed);
        job_.posted.fetch_add(1, std::memory_order_release);
    }

    // A warm posted before the job it prepares is seen is run while waiting for it; one seen later is stale.
    void serve(int part) {
        for (int64_t seen = 0, warmed = 0;;) {
            int64_t now;
            while ((now = job_.posted.load(std::memory_order_acquire)) == seen) {
                const int64_t posted_warm = warm_.posted.load(std::memory_order_acquire);
                if (posted_warm == warmed) {
                    pause();
                    continue;
                }
                warmed = posted_warm;
                warm_.call(warm_.state, part, size_, Waiting(job_.posted, seen));
            }
            seen = now;
            warmed = warm_.posted.load(std::memory_order_acquire);
            if (!job_.call) return;
            if (part < job_.parts) job_.call(job_.body, part, job_.parts);
            working_.value.fetch_sub(1, std::memory_order_release);
        }
    }

    Job job_;
    Warm warm_;
    Counter working_;
    Claims* claims_ = nullptr;  // a thread's, in a line of its own
    int size_ = 1;
};

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>

// Linux hands out the AMX tile registers' state only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); asking twice is harmless. Whether this process may use the tiles.
inline bool qrun_tiles_permitted() {
    static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return permitted;
}

// The tile registers' shapes as ldtilecfg reads them (palette 1): per tile, its rows and bytes a row.
struct alignas(64) QrunTileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
};
#endif

// body(part, parts) run by `threads` threads, each taking its share by its part: on the held team (QrunTeam), else in
// an OpenMP region; at one thread (the engine's count while another process holds a core) by the caller alone,
// outside any region. A one-thread region costs libgomp a team: a 576 x 576 4-bit product at one row took 4.3 us in
// cache without one and 5.0-6.9 us with.
template <typename Body>
inline void qrun_parallel(int threads, const Body& body) {
    if (threads <= 1) return body(0, 1);
    if (QrunTeam* team = QrunTeam::held()) return team->run(std::min(threads, team->size()), body);
#pragma omp parallel num_threads(threads)
    body(omp_get_thread_num(), omp_get_num_threads());
}

// body(first, last) over [0, count), every item once, split over `threads` threads: claimed by the held team's
// threads as each gets to them (QrunTeam::run_claims), else in equal runs.
template <typename Body>
inline void qrun_parallel_claims(int64_t count, int threads, const Body& body) {
    if (threads <= 1 || count <= 1) return body(0, count);
    if (QrunTeam* team = QrunTeam::held()) return team->run_claims(std::min(threads, team->size()), count, body);
#pragma omp parallel num_threads(threads)
    body(count * omp_get_thread_num() / omp_get_num_threads(),
         count * (omp_get_thread_num() + 1) / omp_get_num_threads());
}

// body(i) for i in [0, count): split over `threads` threads in equal runs where `worth_splitting`, else on the calling
// thread without entering a region. An if(false) or one-thread region still costs libgomp a team: ~0.3 us warm,
// ~0.7 us after a matmul has streamed its bookkeeping out of the caches, against ~0.3 us of work in a 576-wide norm; a
// decode step at batch 1 runs ~300 such small loops.
template <typename Body>
inline void qrun_parallel_for(int64_t count, int threads, bool worth_splitting, const Body& body) {
    if (!worth_splitting || threads <= 1 || count <= 1) {
        for (int64_t i = 0; i < count; i++) body(i);
        return;
    }
    qrun_parallel(int(std::min<int64_t>(threads, count)), [&](int part, int parts) {
        for (int64_t i = count * part / parts; i < count * (part + 1) / parts; i++) body(i);
    });
}

// Element i of a row of float32 (QRUN_F32) or bfloat16 (QRUN_BF16) values as a float, and a float stored as one
// (rounded to nearest even). The kind is a template argument, so loops over a row vectorise without a branch per value.
template <int kind>
inline float qrun_load_value(const void* row, int64_t i) {
    if constexpr (kind == QRUN_F32) return static_cast<const float*>(row)[i];
    const uint32_t bits = uint32_t(static_cast<const uint16_t*>(row)[i]) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
}

template <int kind>
inline void qrun_store_value(void* row, int64_t i, float value) {
    if constexpr (kind == QRUN_F32)
        static_cast<float*>(row)[i] = value;
    else
        static_cast<uint16_t*>(row)[i] = qrun_bfloat16_bits(value);
}

// A float as a row of the kind holds it (rounded to nearest even for bfloat16).
template <int kind>
inline float qrun_round_value(float value) {
    if constexpr (kind == QRUN_F32) return value;
    const uint32_t bits = uint32_t(qrun_bfloat16_bits(value)) << 16;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
}

#if defined(__AVX512F__)
#include <immintrin.h>

// 16 values of a float32 (QRUN_F32) or bfloat16 (QRUN_BF16) row from element i as floats, floats as the kind holds
// them (rounded as qrun_bfloat16_bits, NaN too) and stored as it: qrun_load_value, qrun_round_value and
// qrun_store_value 16 at a time.
template <int kind>
inline __m512 qrun_load16(const void* row, int64_t i) {
    if constexpr (kind == QRUN_F32) return _mm512_loadu_ps(static_cast<const float*>(row) + i);
    const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

template <int kind>
inline __m512 qrun_round16(__m512 x) {
    if constexpr (kind == QRUN_F32) return x;
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i sum = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    const __m512i rounded = _mm512_and_si512(sum, _mm512_set1_epi32(int(0xFFFF0000)));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_castsi512_ps(rounded),
                                _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
}

template <int kind>
inline void qrun_store16(void* row, int64_t i, __m512 x) {
    if constexpr (kind == QRUN_F32) return _mm512_storeu_ps(static_cast<float*>(row) + i, x);
    const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(qrun_round16<kind>(x)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(row) + i), _mm512_cvtepi32_epi16(bits));
}
#endif

// Rotary position embedding (Hugging Face's half-split layout) of a head's elements d and d + dim / 2, a and b, as
// torch's addcmul in kernels/rotary.py's reference computes x * cos + rotate_half(x) * sin: the product with cos
// rounded, the one with sin fused into the add.
inline void qrun_rotary_pair(float a, float b, float cos, float sin, float& first, float& second) {
    first = std::fma(b, -sin, a * cos);
    second = std::fma(a, sin, b * cos);
}

// e^x for x <= 0 (attention scores minus their maximum; SiLU's e^-|x|), in plain arithmetic the compiler vectorises:
// 2^n by exponent bits, e^r on |r| <= ln2 / 2 by a degree-6 polynomial (~2 ulp); below -87 (e^x < 1.7e-38) it is 0.
// Its constants: the floor, log2(e), ln 2 in a high and a low part, the polynomial's coefficients (highest first).
struct qrun_exp_constants {
    static constexpr float floor = -87.f, log2e = 1.44269504f, ln2_high = 0.693145752f, ln2_low = 1.42860677e-6f;
    static constexpr float poly[7] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
};

inline float qrun_exp_nonpositive(float x) {
    using C = qrun_exp_constants;
    x = std::max(x, C::floor);
    const float n = std::nearbyint(x * C::log2e);
    const float r = std::fma(n, -C::ln2_high, std::fma(n, -C::ln2_low, x));
    float p = C::poly[0];
    for (int i = 1; i < 7; i++) p = std::fma(p, r, C::poly[i]);
    uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    return x <= C::floor ? 0.f : p * scale;
}

// silu(x) = x / (1 + e^-x), from e^-|x| (never overflowing): qrun_silu16 of one value (the same results).
inline float qrun_silu(float x) {
    const float t = qrun_exp_nonpositive(-std::fabs(x));
    return (x >= 0.f ? x : x * t) / (1.f + t);
}

#if defined(__AVX512F__)
// qrun_exp_nonpositive of 16 floats, step for step (the same results).
inline __m512 qrun_exp_nonpositive16(__m512 x) {
    using C = qrun_exp_constants;
    x = _mm512_max_ps(x, _mm512_set1_ps(C::floor));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(C::log2e)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-C::ln2_high),
                                     _mm512_fmadd_ps(n, _mm512_set1_ps(-C::ln2_low), x));
    __m512 p = _mm512_set1_ps(C::poly[0]);
    for (int i = 1; i < 7; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C::poly[i]));
    const __m512 scale = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
    return _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(C::floor), _CMP_GT_OQ), p, scale);
}
#endif

#if defined(__AVX512F__)
// silu(x) = x / (1 + e^-x) of 16 floats, from e^-|x| (never overflowing): x / (1 + t) for x >= 0, x t / (1 + t) below.
inline __m512 qrun_silu16(__m512 x) {
    const __m512 t = qrun_exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    const __m512 top = _mm512_mask_mul_ps(x, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), x, t);
    return _mm512_div_ps(top, _mm512_add_ps(_mm512_set1_ps(1.f), t));
}

// silu(gate) * up of 16 values of a row of the kind, rounded as activation.py's reference rounds: the SiLU to the
// kind, then the product (as qrun_store16 stores it). kernels/cpu_activation.cpp's pass, and the VNNI kernel's gated
// store.
template <int kind>
inline __m512 qrun_gated16(__m512 gate, __m512 up) {
    return _mm512_mul_ps(qrun_round16<kind>(qrun_silu16(gate)), up);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// qrun_exp_nonpositive of 8 floats, step for step (the same results).
inline __m256 qrun_exp_nonpositive8(__m256 x) {
    using C = qrun_exp_constants;
    x = _mm256_max_ps(x, _mm256_set1_ps(C::floor));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(C::log2e)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-C::ln2_high),
                                     _mm256_fmadd_ps(n, _mm256_set1_ps(-C::ln2_low), x));
    __m256 p = _mm256_set1_ps(C::poly[0]);
    for (int i = 1; i < 7; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C::poly[i]));
    const __m256 scale = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
    return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(C::floor), _CMP_GT_OQ), _mm256_mul_ps(p, scale));
}

// qrun_silu of 8 floats, step for step (the same results).
inline __m256 qrun_silu8(__m256 x) {
    const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.f), x);
    const __m256 t = qrun_exp_nonpositive8(_mm256_sub_ps(_mm256_setzero_ps(), magnitude));
    const __m256 top = _mm256_blendv_ps(x, _mm256_mul_ps(x, t), _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
    return _mm256_div_ps(top, _mm256_add_ps(_mm256_set1_ps(1.f), t));
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// 16 floats as one value for loops the compiler keeps in registers: with AVX2, two 8-float halves, a ymm register
// each. GCC lowers a 64-byte vector type on AVX2 through the stack: the paged attention ran 3.5-11x slower than its
// AVX-512 build on the same Xeon, and prefill chunks 5x slower than torch's SDPA (scripts/attention_speed.py).
struct qrun_floats {
    using Half = float __attribute__((vector_size(32)));
    using HalfMask = int32_t __attribute__((vector_size(32)));
    struct Mask {
        HalfMask lo, hi;
    };
    Half lo, hi;

    float operator[](int64_t i) const { return i < 8 ? lo[i] : hi[i - 8]; }
    float& operator[](int64_t i) { return reinterpret_cast<float*>(this)[i]; }  // vector types alias their elements

    friend qrun_floats operator+(qrun_floats a, qrun_floats b) { return {a.lo + b.lo, a.hi + b.hi}; }
    friend qrun_floats operator-(qrun_floats a, qrun_floats b) { return {a.lo - b.lo, a.hi - b.hi}; }
    friend qrun_floats operator*(qrun_floats a, qrun_floats b) { return {a.lo * b.lo, a.hi * b.hi}; }
    friend qrun_floats operator+(qrun_floats a, float b) { return {a.lo + b, a.hi + b}; }
    friend qrun_floats operator-(qrun_floats a, float b) { return {a.lo - b, a.hi - b}; }
    friend qrun_floats operator*(qrun_floats a, float b) { return {a.lo * b, a.hi * b}; }
    friend qrun_floats operator*(float a, qrun_floats b) { return {a * b.lo, a * b.hi}; }
    qrun_floats& operator+=(qrun_floats b) { return *this = *this + b; }
    friend Mask operator>(qrun_floats a, qrun_floats b) { return {a.lo > b.lo, a.hi > b.hi}; }
    friend Mask operator>=(qrun_floats a, float b) { return {a.lo >= b, a.hi >= b}; }
};

// Lane by lane, a where mask is set, else b (a vector type's mask ? a : b).
inline qrun_floats qrun_select(qrun_floats::Mask mask, qrun_floats a, qrun_floats b) {
    return {mask.lo ? a.lo : b.lo, mask.hi ? a.hi : b.hi};
}

// Lane j of the result is lane j ^ h of a (h: 1, 2, 4 or 8).
template <int h>
inline qrun_floats qrun_swap_lanes(qrun_floats a) {
    if constexpr (h == 8) {
        return {a.hi, a.lo};
    } else {
        const auto half = [](qrun_floats::Half x) {
            return __builtin_shufflevector(x, x, 0 ^ h, 1 ^ h, 2 ^ h, 3 ^ h, 4 ^ h, 5 ^ h, 6 ^ h, 7 ^ h);
        };
        return {half(a.lo), half(a.hi)};
    }
}

// 16 floats from memory and back, a half at a time: a copy of the whole struct (memcpy) goes through the stack in
// 16-byte pieces, whose 32-byte reloads wait on the stores (the rotation's odd factor ran ~10x slower so).
inline qrun_floats qrun_load_floats(const float* at) {
    return {qrun_floats::Half(_mm256_loadu_ps(at)), qrun_floats::Half(_mm256_loadu_ps(at + 8))};
}

inline void qrun_store_floats(float* at, qrun_floats values) {
    _mm256_storeu_ps(at, __m256(values.lo));
    _mm256_storeu_ps(at + 8, __m256(values.hi));
}
#else
// 16 floats as one value (GCC/Clang vector extensions: a zmm register with AVX512), for loops the compiler keeps in
// registers.
using qrun_floats = float __attribute__((vector_size(64)));

// Lane by lane, a where mask is set, else b.
template <typename Mask>
inline qrun_floats qrun_select(Mask mask, qrun_floats a, qrun_floats b) {
    return mask ? a : b;
}

// Lane j of the result is lane j ^ h of a (h: 1, 2, 4 or 8).
template <int h>
inline qrun_floats qrun_swap_lanes(qrun_floats a) {
    return __builtin_shufflevector(a, a, 0 ^ h, 1 ^ h, 2 ^ h, 3 ^ h, 4 ^ h, 5 ^ h, 6 ^ h, 7 ^ h, 8 ^ h, 9 ^ h,
                                   10 ^ h, 11 ^ h, 12 ^ h, 13 ^ h, 14 ^ h, 15 ^ h);
}

// 16 floats from memory and back.
inline qrun_floats qrun_load_floats(const float* at) {
    qrun_floats values;
    std::memcpy(&values, at, sizeof(values));
    return values;
}

inline void qrun_store_floats(float* at, qrun_floats values) { std::memcpy(at, &values, sizeof(values)); }
#endif

extern "C" int qrun_paged_attention(int kv_kind, const float* q, float* out, const void* k_cache,
                                    const void* v_cache, const void* k_scales, const void* v_scales,
                                    const int32_t* block_tables, int64_t table_width, const int32_t* seq_lens,
                                    const int32_t* query_start_loc, int64_t num_seqs, int64_t num_q_heads,
                                    int64_t num_kv_heads, int64_t dim, int64_t block_shift, int64_t group,
                                    float scale, int prefill_chunks, int threads);
extern "C" int qrun_dequantize_int4pack(const uint8_t* packed, const uint16_t* scale_zero, uint16_t* out,
                                        int64_t n_total, int64_t k_total, int64_t out_stride, int64_t group,
                                        int accumulate, int threads);
extern "C" int qrun_quant_matmul_available();
extern "C" int qrun_rotate(const void* x, int64_t ldx, void* out, int64_t ldout, int kind, const float* signs,
                           const float* odd_factor, int64_t odd, int64_t rows, int64_t k, int inverse, int threads);
extern "C" int qrun_reflect(const void* x, void* out, int kind, const float* u, int64_t rows, int64_t heads,
                            int64_t kv_heads, int64_t dim, int threads);
extern "C" void qrun_quant_matmul_warm(const qrun_plane* low, const qrun_plane* high, int gated, int64_t rows,
                                       int64_t n, int64_t group, int read_streams);
extern "C" int qrun_quant_matmul(const void* x, int x_bfloat16, int64_t ldx, const qrun_plane* low,
                                 const qrun_plane* high, void* y, int y_kind, int gated, int64_t ldy, int64_t rows,
                                 int64_t n, int64_t group, int input_digits, int read_streams, int threads);
extern "C" int qrun_quant_matmul_upper_digits(const uint16_t* scales, const uint16_t* high_scales, int64_t n,
                                              int64_t k, int64_t k_high, int64_t group);
extern "C" int qrun_half_gemv(const void* x, int kind, int64_t ldx, const uint16_t* w, const uint16_t* bias, void* y,
                              int64_t ldy, int64_t rows, int64_t n, int64_t k, int read_streams, int threads);
extern "C" int qrun_apply_rotary(int kind, const void* x, int64_t ld, void* out, const int64_t* positions,
                                 const float* cos_sin, int64_t tokens, int64_t heads, int64_t dim, int threads);
extern "C" int qrun_silu_and_mul(int kind, const void* gate, const void* up, int64_t ld, void* out, int64_t rows,
                                 int64_t width, int threads);
extern "C" void qrun_first_max(const float* x, int64_t ld, int64_t rows, int64_t width, int64_t* out, int threads,
                               int not_finite_as_none);
extern "C" void qrun_draw(const float* logits, int64_t ld, int64_t rows, int64_t vocab, const float* temperature,
                          const int64_t* top_k, const float* top_p, const float* min_p, const double* uniforms,
                          int64_t* out, int threads);
extern "C" void qrun_mask_logits(float* logits, int64_t ld, int64_t rows, int64_t vocab, const int32_t* bitmask,
                                 int64_t words, int threads);
extern "C" void qrun_top_logprobs(const float* logits, int64_t ld, int64_t rows, int64_t vocab, const int64_t* tokens,
                                  int64_t top_n, float* chosen, float* top_values, int64_t* top_ids, int threads);
extern "C" double qrun_read_sum(const float* x, int64_t n, int streams, int threads);
extern "C" double qrun_multiply_adds(int64_t rounds, int threads);
extern "C" void qrun_team_claims(int64_t count, int threads, int64_t holder_spin_ns, int64_t* ran);
extern "C" void qrun_team_warm(int threads, int64_t* warmed, int64_t* stopped);
extern "C" int qrun_rms_norm(int kind, const void* x, const void* residual, const void* weight, void* out, void* sum,
                             int64_t rows, int64_t hidden, float eps, int threads);
extern "C" int qrun_store_kv_quantized(const float* keys, const float* values, const int64_t* slots, int64_t tokens,
                                       int64_t heads, int64_t dim, int64_t group, int bits, uint8_t* k_cache,
                                       uint8_t* v_cache, uint16_t* k_scales, uint16_t* v_scales);
extern "C" int qrun_dequantize_planes(const qrun_plane* low, const qrun_plane* high, int64_t n, int64_t group,
                                      uint16_t* out, int64_t ldo, int threads);
extern "C" int qrun_quant_matmul_tiles_available();
extern "C" int qrun_quant_matmul_tiles(const uint16_t* x, int64_t ldx, const qrun_plane* low, const qrun_plane* high,
                                       void* y, int y_bfloat16, int64_t ldy, int64_t rows, int64_t n, int64_t group,
                                       int dequantize_weights, int threads);
