/* What a shard's load does to every weight, compiled (see shardline/models/native_dequant.py,
 * which compiles and loads this file): GGUF blocks of every type shardline reads unpacked
 * into integer groups in one pass (unpack_blocks; numpy's unpackers took several passes
 * and temporaries: 4 of a 1.5B Q4_K_M model's 9 s of load),
 * and integer values packed into torch's CPU int4 layout (int4_pack_halves, which
 * shardline/models/int4_planes.py's pack_int4_planes calls in place of
 * torch._convert_weight_to_int4pack_for_cpu, which takes int32 values: a 4-byte copy of
 * every weight before packing).
 *
 * int4_pack_halves:
 * The layout for blocks of 2 * half rows, "halves" order: [rows / (2 half), cols, half]
 * bytes, byte j of a block's column k holding row j (low nibble) and row j + half (high
 * nibble) of the block. Each value is ((q >> shift) & 15) + add, which the caller keeps
 * in 0..15 (a plane of a wider integer: its low or high four bits, re-centred). */
#include <stdint.h>
#include <string.h>
#include "kernels.h"
#ifdef __F16C__
#include <immintrin.h>
#endif

/* Bytes ((x >> shift) & 15) + add of the 8 bytes of x, at once (no byte carries: each
 * result is at most 15). */
static inline uint64_t nibbles_8(uint64_t x, int shift, int add) {
    return ((x >> shift) & 0x0F0F0F0F0F0F0F0Full) + 0x0101010101010101ull * (uint64_t)add;
}

/* An 8 x 8 byte transpose: byte c of r[i] goes to byte i of r[c] (swaps of 1, 2 and 4
 * bytes between rows 1, 2 and 4 apart; little-endian byte order). */
static inline void transpose_8x8(uint64_t *r) {
    for (int i = 0; i < 8; i += 2) {
        uint64_t t = ((r[i] >> 8) ^ r[i + 1]) & 0x00FF00FF00FF00FFull;
        r[i + 1] ^= t;
        r[i] ^= t << 8;
    }
    static const int twos[4] = {0, 1, 4, 5};
    for (int n = 0; n < 4; n++) {
        int i = twos[n];
        uint64_t t = ((r[i] >> 16) ^ r[i + 2]) & 0x0000FFFF0000FFFFull;
        r[i + 2] ^= t;
        r[i] ^= t << 16;
    }
    for (int i = 0; i < 4; i++) {
        uint64_t t = ((r[i] >> 32) ^ r[i + 4]) & 0x00000000FFFFFFFFull;
        r[i + 4] ^= t;
        r[i] ^= t << 32;
    }
}

void int4_pack_halves(const uint8_t *restrict q, int64_t rows, int64_t cols, int shift,
                      int add, int64_t half, uint8_t *restrict out, int threads) {
    const int64_t block = 2 * half;
    if (half % 8 == 0 && cols % 8 == 0) { /* 8 rows by 8 columns at a time, transposed */
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t b = 0; b < rows / block; b++) {
            uint8_t *restrict o = out + b * cols * half;
            for (int64_t k = 0; k < cols; k += 8)
                for (int64_t j = 0; j < half; j += 8) {
                    uint64_t r[8];
                    for (int i = 0; i < 8; i++) {
                        uint64_t lo, hi;
                        memcpy(&lo, q + (b * block + j + i) * cols + k, 8);
                        memcpy(&hi, q + (b * block + j + i + half) * cols + k, 8);
                        r[i] = (nibbles_8(lo, shift, add) & 0x0F0F0F0F0F0F0F0Full) |
                               (nibbles_8(hi, shift, add) << 4);
                    }
                    transpose_8x8(r);
                    for (int c = 0; c < 8; c++) memcpy(o + (k + c) * half + j, &r[c], 8);
                }
        }
        return;
    }
    for (int64_t b = 0; b < rows / block; b++) {
        uint8_t *restrict o = out + b * cols * half;
        for (int64_t j = 0; j < half; j++) {
            const uint8_t *restrict lo = q + (b * block + j) * cols;
            const uint8_t *restrict hi = lo + half * cols;
            for (int64_t k = 0; k < cols; k++) {
                uint8_t l = (uint8_t)(((lo[k] >> shift) & 15) + add);
                uint8_t h = (uint8_t)(((hi[k] >> shift) & 15) + add);
                o[k * half + j] = (uint8_t)((l & 15) | (h << 4));
            }
        }
    }
}

/* IEEE half to float, subnormals, infinities and NaNs included (F16C's conversion where
 * the build has it: the same values, a NaN's payload aside). */
static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0 && man == 0) {
        bits = sign;
    } else if (exp == 0) { /* subnormal: man * 2^-24, normalised */
        uint32_t e = 0;
        while (!(man & 0x400u)) {
            man <<= 1;
            e++;
        }
        bits = sign | ((113u - e) << 23) | ((man & 0x3FFu) << 13);
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* The kinds unpack_blocks takes (shardline/models/native_dequant.py's _UNPACKED). */
enum { Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K };

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

/* Bytes of a block per kind, and weights in it. */
static const int64_t BLOCK_BYTES[] = {18, 20, 34, 22, 24, 144, 176, 210};
static const int64_t BLOCK_WEIGHTS[] = {32, 32, 32, 32, 32, 256, 256, 256};

/* Q4_K / Q5_K's 12 bytes of 6-bit scales and minimums of 8 groups (ggml-common.h). */
static inline void k_scales(const uint8_t *s, float *sc, float *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = (float)(s[j] & 63);
        mn[j] = (float)(s[4 + j] & 63);
        sc[4 + j] = (float)((s[8 + j] & 15) | ((s[j] >> 6) << 4));
        mn[4 + j] = (float)((s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4));
    }
}

/* One block into its weights' q and its groups' scale and offset (inlined per kind, so
 * each kind's loops are its own and vectorize). */
static inline __attribute__((always_inline)) void unpack_block(const uint8_t *restrict blk, int kind, uint8_t *restrict out,
                         float *restrict scale, float *restrict offset) {
    if (kind == Q8_0) {
        float d = f16_at(blk);
        scale[0] = d;
        offset[0] = -128.0f * d;
        for (int i = 0; i < 32; i++) out[i] = blk[2 + i] ^ 0x80u;
    } else if (kind <= Q5_1) { /* 32 weights: nibble byte i holds weights i and i + 16 */
        float d = f16_at(blk);
        scale[0] = d;
        offset[0] = kind == Q4_0 ? -8.0f * d : kind == Q5_0 ? -16.0f * d : f16_at(blk + 2);
        const uint8_t *nib = blk + (kind == Q4_0 ? 2 : kind == Q4_1 ? 4 : kind == Q5_0 ? 6 : 8);
        for (int i = 0; i < 16; i++) {
            out[i] = nib[i] & 15u;
            out[i + 16] = nib[i] >> 4;
        }
        if (kind == Q5_0 || kind == Q5_1) { /* bit i of qh is weight i's fifth */
            uint32_t qh;
            memcpy(&qh, blk + (kind == Q5_0 ? 2 : 4), 4);
            for (int i = 0; i < 32; i++) out[i] |= (uint8_t)(((qh >> i) & 1u) << 4);
        }
    } else if (kind == Q4_K || kind == Q5_K) { /* 8 groups of 32: w = d sc q - dmin m */
        float d = f16_at(blk), dmin = f16_at(blk + 2), sc[8], mn[8];
        k_scales(blk + 4, sc, mn);
        const uint8_t *qh = blk + 16, *qs = blk + (kind == Q4_K ? 16 : 48);
        for (int j = 0; j < 8; j++) {
            scale[j] = d * sc[j];
            offset[j] = -(dmin * mn[j]);
        }
        /* runs of 32 bytes: weights 64 r + l (low nibble) and 64 r + 32 + l (high); Q5_K's
         * fifth bit of weight 32 j + l is bit j of qh[l] */
        for (int r = 0; r < 4; r++)
            for (int l = 0; l < 32; l++) {
                uint8_t byte = qs[32 * r + l];
                uint8_t lo = byte & 15u, hi = byte >> 4;
                if (kind == Q5_K) {
                    lo |= (uint8_t)(((qh[l] >> (2 * r)) & 1u) << 4);
                    hi |= (uint8_t)(((qh[l] >> (2 * r + 1)) & 1u) << 4);
                }
                out[64 * r + l] = lo;
                out[64 * r + 32 + l] = hi;
            }
    } else { /* Q6_K, 16 groups of 16: w = d sc (q - 32) */
        const uint8_t *ql = blk, *qh = blk + 128;
        float d = f16_at(blk + 208);
        for (int j = 0; j < 16; j++) {
            scale[j] = d * (float)(int8_t)blk[192 + j];
            offset[j] = -32.0f * scale[j];
        }
        /* each half of 128: ql's 64 bytes hold weights l (low) and 64 + l (high), qh's 32
         * bytes the top two bits of weight 32 i + l in bits 2 i, 2 i + 1 of byte l */
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                uint8_t a = ql[64 * h + l], b = ql[64 * h + 32 + l], top = qh[32 * h + l];
                uint8_t *o = out + 128 * h + l;
                o[0] = (uint8_t)((a & 15u) | ((top & 3u) << 4));
                o[32] = (uint8_t)((b & 15u) | (((top >> 2) & 3u) << 4));
                o[64] = (uint8_t)((a >> 4) | (((top >> 4) & 3u) << 4));
                o[96] = (uint8_t)((b >> 4) | (((top >> 6) & 3u) << 4));
            }
    }
}

/* GGUF blocks (ggml-common.h) unpacked into integer groups: q[r, c] (uint8), scale[r, g]
 * and offset[r, g] (float32, groups of 32 weights, 16 for Q6_K) with w = q scale +
 * offset: the values of shardline/models/gguf_quants.py's numpy unpackers (the
 * reference), bit for bit. `data` is rows x blocks blocks of the kind's size. */
void unpack_blocks(const uint8_t *restrict data, int64_t rows, int64_t blocks, int kind,
                   uint8_t *restrict q, float *restrict scale, float *restrict offset, int threads) {
    const int64_t size = BLOCK_BYTES[kind], weights = BLOCK_WEIGHTS[kind];
    const int64_t groups = kind == Q6_K ? 16 : weights / 32;
#define UNPACK_ALL(K)                                                                        \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                        \
    for (int64_t at = 0; at < rows * blocks; at++)                                           \
        unpack_block(data + at * size, K, q + at * weights, scale + at * groups, offset + at * groups)
    switch (kind) {
    case Q4_0: UNPACK_ALL(Q4_0); break;
    case Q4_1: UNPACK_ALL(Q4_1); break;
    case Q8_0: UNPACK_ALL(Q8_0); break;
    case Q5_0: UNPACK_ALL(Q5_0); break;
    case Q5_1: UNPACK_ALL(Q5_1); break;
    case Q4_K: UNPACK_ALL(Q4_K); break;
    case Q5_K: UNPACK_ALL(Q5_K); break;
    default: UNPACK_ALL(Q6_K); break;
    }
#undef UNPACK_ALL
}

/* 5- or 6-bit integers q [rows, cols] (rows a multiple of 16, cols of 32) in the layout
 * of shardline/models/packed_groups.py (its numpy packing is the reference). A row's chunk
 * of 32 weights has 16 low bytes (byte j: weight j's low nibble, and weight j + 16's as
 * its high one) and 4 (bits - 4) high bytes (for 6 bits byte j holds the top two bits of
 * weights j, j + 8, j + 16, j + 24 in bit pairs 0-1 .. 6-7, for 5 bits bit b of byte j is
 * weight 8 j + b's fifth); the rows go in blocks of 16, and a block's chunk c is its rows'
 * bytes of chunk c dword by dword: dword d of row i at dword 16 d + i. */
void pack_groups_bits(const uint8_t *restrict q, int64_t rows, int64_t cols, int bits,
                      uint8_t *restrict low, uint8_t *restrict high, int threads) {
    const int64_t per_row = cols / 32, chunks = rows * per_row, hb = bits - 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const uint8_t *restrict w = q + c * 32;
        int64_t row = c / per_row, at = (row / 16) * per_row + c % per_row, lane = row % 16;
        uint8_t l[16], h[8];
        for (int j = 0; j < 16; j++) l[j] = (uint8_t)((w[j] & 15u) | ((w[j + 16] & 15u) << 4));
        if (bits == 6) {
            for (int j = 0; j < 8; j++)
                h[j] = (uint8_t)((w[j] >> 4) | ((w[j + 8] >> 4) << 2) | ((w[j + 16] >> 4) << 4) |
                                 ((w[j + 24] >> 4) << 6));
        } else {
            for (int j = 0; j < 4; j++) {
                uint8_t byte = 0;
                for (int b = 0; b < 8; b++) byte |= (uint8_t)((w[8 * j + b] >> 4) << b);
                h[j] = byte;
            }
        }
        for (int d = 0; d < 4; d++) memcpy(low + at * 256 + (16 * d + lane) * 4, l + 4 * d, 4);
        for (int d = 0; d < hb; d++) memcpy(high + at * 64 * hb + (16 * d + lane) * 4, h + 4 * d, 4);
    }
}

/* A plane's scales s and zeros z, float32 [rows, groups], rounded to bfloat16 as torch
 * rounds (to nearest even; a NaN to 0x7FC0) into rows [start, start + rows) of out
 * [groups, out_rows, 2] (torch's int4 scales-and-zeros layout). */
void scales_zeros_bf16(const float *restrict s, const float *restrict z, int64_t rows,
                       int64_t groups, uint16_t *restrict out, int64_t out_rows, int64_t start,
                       int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        uint16_t *restrict o = out + (g * out_rows + start) * 2;
        for (int64_t r = 0; r < rows; r++) {
            float a = s[r * groups + g], b = z[r * groups + g];
            o[2 * r] = a != a ? 0x7FC0u : to_bf16(a);
            o[2 * r + 1] = b != b ? 0x7FC0u : to_bf16(b);
        }
    }
}
