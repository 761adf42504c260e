// Structured outputs' token masks applied to logits: kernels/token_bitmask.py's mask_logits_ref in one pass over each
// row. Documented by kernels/cpu_token_bitmask.py.

#include <cstdint>
#include <limits>

#include "cpu_kernels.h"

// In place: logits[r * ld + t] = -inf for each token t < vocab whose bit t % 32 of word t / 32 of row r of bitmask
// [rows, words] is 0, and for every t >= 32 words.
extern "C" void qrun_mask_logits(float* logits, int64_t ld, int64_t rows, int64_t vocab, const int32_t* bitmask,
                                 int64_t words, int threads) {
    qrun_parallel_for(rows, threads, rows > 1, [&](int64_t r) {
        float* row = logits + r * ld;
        const uint32_t* mask = reinterpret_cast<const uint32_t*>(bitmask + r * words);
        for (int64_t t = 0; t < vocab; t++)
            if (t >= 32 * words || !((mask[t >> 5] >> (t & 31)) & 1u)) row[t] = -std::numeric_limits<float>::infinity();
    });
}
