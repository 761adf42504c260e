// How a plane of cpu_quant_matmul.cpp's 4-bit digits is stored: in as few bits a digit as its codes need (1-4), so a
// 2- or 3-bit matrix, or the upper digits of a 6-bit one, is read from memory at its own width rather than as
// nibbles. The kernels' arithmetic is the 4-bit layout's: the VNNI kernel takes a block's code vectors from
// qrun_plane_vectors, the others its slices from qrun_plane_slice, each from whatever the plane stores. Layout and
// reasons: cpu_quant_matmul.py.
//
// A block of a channel tile (16 channels x 32 inputs) holds 64 x bits bytes. In the 4-bit layout slice s (64 bytes)
// holds in byte 4c + j, for channel c, the codes of inputs 8s + j (low nibble) and 8s + 4 + j (high nibble): code
// vector q = 0..7 (inputs 4q + j) in slice q / 2, nibble q % 2. Narrower, the same vectors pack 8 / bits to a byte:
//   2 bits: 2 slices, vector q in slice q / 4, bits 2 (q % 4) and up;
//   1 bit:  1 slice, vector q in bit q;
//   3 bits: 3 slices, vectors 2s and 2s + 1 in slice s's bits 0 and 3 (s = 0, 1, 2), vectors 6 and 7's low 2 bits in
//           bits 6 and 7 of slices 0 and 1, their third bits in bits 6 and 7 of slice 2.

#pragma once

#include <cstdint>

#if defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// One plane: [n, k] codes of `bits` bits a code in the layout above (n / 16 channel tiles, each k / 32 blocks in
// order), float16 scales and zeros [n / 16][k / group][16], int8 centers [k / 32] (one value per group): w = (code -
// center) * scale + zero.
struct qrun_plane {
    const uint8_t* codes = nullptr;
    const uint16_t* scales = nullptr;
    const uint16_t* zeros = nullptr;
    const int8_t* centers = nullptr;
    int64_t k = 0;  // the inputs it covers: all, or a high plane's first k_high
    int bits = 4;

    int64_t block_bytes() const { return 64 * int64_t(bits); }
    // Channel tile `tile`'s block b.
    const uint8_t* block(int64_t tile, int64_t b) const { return codes + (tile * (k / 32) + b) * block_bytes(); }
};

// Whether a product's planes fit the layout: an [n, low.k] weight in groups of `group` inputs, and a high plane
// (null: none) over a prefix of whole groups.
inline bool qrun_planes_fit(const qrun_plane& low, const qrun_plane* high, int64_t n, int64_t group) {
    const auto fits = [group](const qrun_plane& plane) {
        return plane.bits >= 1 && plane.bits <= 4 && plane.k >= 0 && plane.k % group == 0;
    };
    return n % 16 == 0 && group > 0 && group % 32 == 0 && fits(low) && (!high || (fits(*high) && high->k <= low.k));
}

#if defined(__AVX512BW__) || defined(__AVX2__)
namespace qrun_planes {

// The few operations the unpacking needs beyond & and | (GCC's and Clang's vector types have those), for 64-byte
// (AVX512) and 32-byte (AVX2: half a slice) vectors. Every helper of the unpacking is always inlined: left to the
// inliner, whose budget is the whole file's growth, GCC once made three_bit_vector a call through the PLT, 20 of them
// in the AVX2 tile loop, when cpu_quant_matmul.cpp grew by a few functions (the engine's 4.0-bpw single stream on a
// 2-core Zen 3 EPYC ~0.7x, one-off probes).
#if defined(__AVX512BW__)
[[gnu::always_inline]] inline __m512i load(const uint8_t* at, __m512i) { return _mm512_loadu_si512(at); }
[[gnu::always_inline]] inline __m512i bytes(int value, __m512i) { return _mm512_set1_epi8(char(value)); }
[[gnu::always_inline]] inline __m512i shift_right(__m512i a, int bits) { return _mm512_srli_epi16(a, unsigned(bits)); }
[[gnu::always_inline]] inline __m512i shift_left(__m512i a, int bits) { return _mm512_slli_epi16(a, unsigned(bits)); }
#endif
[[gnu::always_inline]] inline __m256i load(const uint8_t* at, __m256i) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
}
[[gnu::always_inline]] inline __m256i bytes(int value, __m256i) { return _mm256_set1_epi8(char(value)); }
[[gnu::always_inline]] inline __m256i shift_right(__m256i a, int bits) { return _mm256_srli_epi16(a, bits); }
[[gnu::always_inline]] inline __m256i shift_left(__m256i a, int bits) { return _mm256_slli_epi16(a, bits); }

// Vectors 2s and 2s + 1 of a 2-bit slice's bytes (s = 0 or 1 within it) as nibbles. The 16-bit shifts bring the next
// byte's bits into each byte's top, which the masks drop.
template <typename V>
[[gnu::always_inline]] inline V pairs_as_nibbles(V packed, int s) {
    const V shifted = shift_right(packed, 4 * s);
    return (shifted & bytes(0x03, V{})) | shift_left(shifted & bytes(0x0C, V{}), 2);
}

// Vectors 2s and 2s + 1 of a 1-bit slice's bytes as nibbles.
template <typename V>
[[gnu::always_inline]] inline V bits_as_nibbles(V packed, int s) {
    const V shifted = shift_right(packed, 2 * s);
    return (shifted & bytes(0x01, V{})) | shift_left(shifted & bytes(0x02, V{}), 3);
}

// Vector q of a 3-bit block (the layout above): a shift and a mask for vectors 0-5, two of each for 6 and 7.
template <typename V>
[[gnu::always_inline]] inline V three_bit_vector(const uint8_t* block, int q) {
    if (q < 6) return shift_right(load(block + 64 * (q / 2), V{}), 3 * (q % 2)) & bytes(7, V{});
    return (shift_right(load(block + 64 * (q - 6), V{}), 6) & bytes(3, V{})) |
           (shift_right(load(block + 128, V{}), q - 2) & bytes(4, V{}));
}

}  // namespace qrun_planes

#if defined(__AVX512BW__)
namespace qrun_planes {

template <int bits>
[[gnu::always_inline]] inline void vectors_of(const uint8_t* block, __m512i vectors[8]) {
    if constexpr (bits == 3) {
        for (int q = 0; q < 8; q++) vectors[q] = three_bit_vector<__m512i>(block, q);
    } else {
        constexpr int per_byte = 8 / bits;
        const __m512i mask = _mm512_set1_epi8(char((1 << bits) - 1));
        for (int slice = 0; slice < bits; slice++) {
            const __m512i packed = _mm512_loadu_si512(block + 64 * slice);
            vectors[slice * per_byte] = _mm512_and_si512(packed, mask);
            for (int p = 1; p < per_byte; p++)
                vectors[slice * per_byte + p] = _mm512_and_si512(_mm512_srli_epi16(packed, unsigned(bits * p)), mask);
        }
    }
}

// Vector q of a block of upper digits in bits 4-7 of each byte, bits 0-3 left as they fall (the caller selects the
// low digit's there): 4 bits as the nibbles lie (a shift for the even vectors), 2 and 1 bits a shift and a mask.
template <int bits>
[[gnu::always_inline]] inline void upper_vectors_of(const uint8_t* block, __m512i vectors[8]) {
    if constexpr (bits == 4) {
        for (int s = 0; s < 4; s++) {
            const __m512i packed = _mm512_loadu_si512(block + 64 * s);
            vectors[2 * s] = _mm512_slli_epi16(packed, 4);
            vectors[2 * s + 1] = packed;
        }
    } else if constexpr (bits == 3) {
        for (int q = 0; q < 8; q++) vectors[q] = _mm512_slli_epi16(three_bit_vector<__m512i>(block, q), 4);
    } else {
        constexpr int per_byte = 8 / bits;
        const __m512i mask = _mm512_set1_epi8(char(((1 << bits) - 1) << 4));
        for (int slice = 0; slice < bits; slice++) {
            const __m512i packed = _mm512_loadu_si512(block + 64 * slice);
            for (int p = 0; p < per_byte; p++) {  // bits * p up to bit 4: the 16-bit shifts' spill lands below it
                const int shift = 4 - bits * p;
                const __m512i moved = shift >= 0 ? _mm512_slli_epi16(packed, unsigned(shift))
                                                 : _mm512_srli_epi16(packed, unsigned(-shift));
                vectors[slice * per_byte + p] = _mm512_and_si512(moved, mask);
            }
        }
    }
}

}  // namespace qrun_planes

// The 8 code vectors of a block (vector q: inputs 4q + j of each channel in byte 4c + j, below 2^bits) from its
// bytes at `block` in a plane of `bits` bits a code: vpdpbusd's operands, a shift and a mask each (3 bits: two of
// each for vectors 6 and 7).
[[gnu::always_inline]] inline void qrun_plane_vectors(const uint8_t* block, int bits, __m512i vectors[8]) {
    switch (bits) {
        case 1:
            return qrun_planes::vectors_of<1>(block, vectors);
        case 2:
            return qrun_planes::vectors_of<2>(block, vectors);
        case 3:
            return qrun_planes::vectors_of<3>(block, vectors);
        default:
            return qrun_planes::vectors_of<4>(block, vectors);
    }
}

// qrun_plane_vectors for a plane of upper digits, each vector's digits in bits 4-7 of its bytes and bits 0-3 left as
// they fall: one select (vpternlogd) a vector joins them to a 4-bit plane's digits.
[[gnu::always_inline]] inline void qrun_plane_upper_vectors(const uint8_t* block, int bits, __m512i vectors[8]) {
    switch (bits) {
        case 1:
            return qrun_planes::upper_vectors_of<1>(block, vectors);
        case 2:
            return qrun_planes::upper_vectors_of<2>(block, vectors);
        case 3:
            return qrun_planes::upper_vectors_of<3>(block, vectors);
        default:
            return qrun_planes::upper_vectors_of<4>(block, vectors);
    }
}
#endif

// Slice s (0-3) of a block in the 4-bit layout, from the block's bytes at `block` in a plane of `bits` bits a code: V
// __m512i for the whole slice, or __m256i for the half at `block` + 32 h (each byte's place is the same in every
// width, so half h of the block's slices is half h of the slice).
template <typename V>
[[gnu::always_inline]] inline V qrun_plane_slice(const uint8_t* block, int bits, int s) {
    using namespace qrun_planes;
    switch (bits) {
        case 4:
            return load(block + 64 * s, V{});
        case 2:
            return pairs_as_nibbles(load(block + 64 * (s / 2), V{}), s % 2);
        case 1:
            return bits_as_nibbles(load(block, V{}), s);
        default:  // 3
            return three_bit_vector<V>(block, 2 * s) | shift_left(three_bit_vector<V>(block, 2 * s + 1), 4);
    }
}
#endif
