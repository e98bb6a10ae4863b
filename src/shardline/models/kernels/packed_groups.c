/* Packed 5- and 6-bit groups (shardline/models/packed_groups.py, which holds them, and
 * native_dequant.py, which calls these): their layout, the dequantization of rows (the
 * embedding, the LM head's refined logits) and of a block of rows transposed (a prefill
 * GEMM's operand), the float32 decode product of float32 weights and, where AVX-512 VNNI
 * is built, the int8-activation decode product of bfloat16 weights (also called by the
 * fused decode layers, decode_layer.c).
 *
 * Every dequantized value is computed in float32 as (q - center) * scale or q * scale +
 * offset with no fused multiply-add (built with -ffp-contract=off) and rounded once to the
 * output dtype: bit for bit the eager torch code of packed_groups.py. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* 5- or 6-bit integer groups split into a nibble plane and a high-bit plane
 * (shardline/models/packed_groups.py; kernels.h's packed_groups_t). A row is a run of
 * 32-weight chunks; chunk c has 16 bytes of low nibbles (byte j: weight j in the low
 * nibble, weight j + 16 in the high one) and 4 hb bytes of high bits, hb = bits - 4: for
 * hb = 2, byte j (< 8) holds weights j, j + 8, j + 16, j + 24 in bits 0-1, 2-3, 4-5, 6-7;
 * for hb = 1, weight i's bit is bit i of the little-endian 32-bit word. The rows go in
 * blocks of 16: a block's chunk c is 256 low bytes then (in the high plane) 64 hb bytes,
 * each its rows' dwords of that chunk, dword d of row i at dword 16 d + i; scale, and
 * offset where it is not NULL, hold one value per group of `group` weights (16 or 32) of
 * each row, [blocks, groups, 16] (bfloat16 when scales_bf16 else float32):
 * w = q * scale + offset, or (q - center) * scale without one (the form of GGUF's
 * symmetric types, e.g. Q6_K's d * sc * (q - 32)). With a codebook (MXFP4's) hb is 0 and
 * a nibble is a code c whose integer q is codebook[c]. */
typedef struct {
    const uint8_t *low, *high;    /* the row's dword 0 of chunk 0 */
    const uint8_t *scale, *offset; /* the row's group 0 */
    int center, hb, scales_bf16;
    int64_t group, K;
    const uint8_t *codebook;
} packed_row_t;

/* Group g's scale (or offset) of a row whose group 0 is at p. */
static inline float scalar_at(const uint8_t *p, int64_t g, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)p)[16 * g]) : ((const float *)p)[16 * g];
}

/* Where block b of 16 rows starts in each of w's planes and scales (offset NULL without). */
typedef struct {
    const uint8_t *low, *high, *scale, *offset;
} packed_block_t;

static inline packed_block_t block_at(const packed_groups_t *w, int64_t b) {
    int64_t chunks = w->K / 32, scales = b * (w->K / w->group) * 16 * (w->scales_bf16 ? 2 : 4);
    packed_block_t at = {w->low + b * chunks * 256, w->high + b * chunks * 64 * w->hb,
                         (const uint8_t *)w->scale + scales,
                         w->offset ? (const uint8_t *)w->offset + scales : NULL};
    return at;
}

static inline packed_row_t packed_at(const packed_groups_t *w, int64_t r) {
    packed_block_t at = block_at(w, r / 16);
    int64_t lane = r % 16, size = w->scales_bf16 ? 2 : 4;
    packed_row_t row = {at.low + lane * 4, at.high + lane * 4, at.scale + lane * size,
                        at.offset ? at.offset + lane * size : NULL,
                        w->center, w->hb, w->scales_bf16, w->group, w->K, w->codebook};
    return row;
}

static inline int32_t dword_at(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Chunk c's 16 low and 4 hb high bytes of the row. */
static inline void chunk_bytes(const packed_row_t *w, int64_t c, uint8_t *l, uint8_t *h) {
    for (int d = 0; d < 4; d++) memcpy(l + 4 * d, w->low + c * 256 + 64 * d, 4);
    for (int d = 0; d < w->hb; d++) memcpy(h + 4 * d, w->high + c * 64 * w->hb + 64 * d, 4);
}

/* Chunk c's 32 integers (0 .. 2^bits - 1). */
static inline void chunk_ints(const packed_row_t *w, int64_t c, int32_t *restrict q) {
    uint8_t l[16], h[8];
    chunk_bytes(w, c, l, h);
    for (int j = 0; j < 16; j++) {
        q[j] = l[j] & 15;
        q[j + 16] = l[j] >> 4;
    }
    if (w->codebook) {
        for (int i = 0; i < 32; i++) q[i] = w->codebook[q[i]];
    } else if (w->hb == 2) {
        for (int j = 0; j < 8; j++)
            for (int part = 0; part < 4; part++) q[j + 8 * part] |= ((h[j] >> (2 * part)) & 3) << 4;
    } else {
        for (int i = 0; i < 32; i++) q[i] |= ((h[i / 8] >> (i % 8)) & 1) << 4;
    }
}

/* Writes rows ids[0 .. n) (rows 0 .. n when ids is NULL) of w one after another into out
 * (bfloat16 when out_bf16, else float32), each value computed in float32 without fused
 * multiply-adds; work is float32 [K]. */
void packed_groups_rows(const packed_groups_t *pw, const int64_t *ids, int64_t n, void *out,
                        int out_bf16, float *work) {
    int64_t K = pw->K, group = pw->group;
    for (int64_t r = 0; r < n; r++) {
        packed_row_t w = packed_at(pw, ids ? ids[r] : r);
        float *d = out_bf16 ? work : (float *)out + r * K;
        int32_t q[32];
        for (int64_t c = 0; c < K / 32; c++) {
            chunk_ints(&w, c, q);
            for (int j0 = 0; j0 < 32; j0 += (int)group) {
                int64_t g = (c * 32 + j0) / group;
                float s = scalar_at(w.scale, g, w.scales_bf16);
                float *restrict dg = d + c * 32 + j0;
                if (w.offset) {
                    float o = scalar_at(w.offset, g, w.scales_bf16);
                    for (int j = 0; j < group; j++) dg[j] = (float)q[j0 + j] * s + o;
                } else {
                    for (int j = 0; j < group; j++) dg[j] = (float)(q[j0 + j] - w.center) * s;
                }
            }
        }
        if (out_bf16) {
            uint16_t *restrict o = (uint16_t *)out + r * K;
            for (int64_t k = 0; k < K; k++) o[k] = to_bf16(d[k]);
        }
    }
}

/* The float32 decode product. For each group, g = the sum over its weights of q' * x (q' = q -
 * center, or q with an offset) in 8 float32 lanes, then acc += scale * g (lane-wise), and
 * with an offset o += offset * (the group's sum of x, xsum); the output is acc's lanes
 * summed, plus o. One sequence takes its products as a chunk is unpacked; more take them
 * from the chunk's values unpacked once into float32 work (the same operations in the
 * same order: an output does not depend on the other rows of x). */
#ifdef __AVX2__
/* Chunk c's 32 integers q' as four float32 vectors (weights 0-7, 8-15, 16-23, 24-31). */
static inline void chunk_vectors(const packed_row_t *w, int64_t c, __m256 *f) {
    const __m128i m4 = _mm_set1_epi8(15);
    const uint8_t *l = w->low + c * 256, *hp = w->high + c * 64 * w->hb;
    __m128i lb = _mm_setr_epi32(dword_at(l), dword_at(l + 64), dword_at(l + 128), dword_at(l + 192));
    __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(lb, 4), m4), _mm_and_si128(lb, m4));
    __m256i hi = _mm256_setzero_si256();
    if (w->codebook) { /* the codes' integers, by byte shuffle within each 16-byte lane */
        __m128i book = _mm_loadu_si128((const __m128i *)w->codebook);
        nib = _mm256_shuffle_epi8(_mm256_set_m128i(book, book), nib);
    } else if (w->hb == 2) {
        int64_t h = (int64_t)((uint64_t)(uint32_t)dword_at(hp) |
                              (uint64_t)(uint32_t)dword_at(hp + 64) << 32);
        hi = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(h), _mm256_setr_epi64x(0, 2, 4, 6)),
                              _mm256_set1_epi8(3));
    } else {
        int32_t h = dword_at(hp);
        const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        const __m256i bits = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
        __m256i hv = _mm256_shuffle_epi8(_mm256_set1_epi32(h), spread);
        hi = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hv, bits), bits), _mm256_set1_epi8(1));
    }
    __m256i q = _mm256_or_si256(nib, _mm256_slli_epi16(hi, 4));
    /* q' = q - center as signed bytes (q itself with an offset: below 64, a positive byte) */
    if (!w->offset) q = _mm256_sub_epi8(q, _mm256_set1_epi8((char)w->center));
    __m128i lo128 = _mm256_castsi256_si128(q), hi128 = _mm256_extracti128_si256(q, 1);
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo128));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo128, 8)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi128));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi128, 8)));
}

/* Chunk c's products with x (its 32 values) into acc and o. */
static inline void chunk_dot(const packed_row_t *w, int64_t c, const __m256 *f,
                             const float *restrict x, const float *restrict xsum, __m256 *acc,
                             float *o) {
    __m256 p0 = _mm256_mul_ps(f[0], _mm256_loadu_ps(x));
    __m256 p2 = _mm256_mul_ps(f[2], _mm256_loadu_ps(x + 16));
    p0 = _mm256_add_ps(p0, _mm256_mul_ps(f[1], _mm256_loadu_ps(x + 8)));
    p2 = _mm256_add_ps(p2, _mm256_mul_ps(f[3], _mm256_loadu_ps(x + 24)));
    if (w->group == 16) {
        int64_t g = 2 * c;
        *acc = _mm256_add_ps(*acc, _mm256_mul_ps(_mm256_set1_ps(scalar_at(w->scale, g, w->scales_bf16)), p0));
        *acc = _mm256_add_ps(*acc, _mm256_mul_ps(_mm256_set1_ps(scalar_at(w->scale, g + 1, w->scales_bf16)), p2));
        if (w->offset) {
            *o += scalar_at(w->offset, g, w->scales_bf16) * xsum[g];
            *o += scalar_at(w->offset, g + 1, w->scales_bf16) * xsum[g + 1];
        }
    } else {
        *acc = _mm256_add_ps(*acc, _mm256_mul_ps(_mm256_set1_ps(scalar_at(w->scale, c, w->scales_bf16)),
                                                 _mm256_add_ps(p0, p2)));
        if (w->offset) *o += scalar_at(w->offset, c, w->scales_bf16) * xsum[c];
    }
}
#endif

/* y[m * rows + r] = sum over k of W[r, k] * x[m, k] for x float32 [M, K] (the weight's
 * rows and K in w). Each group's sum of x (read only with offsets) is summed here, in
 * order. Threads (OpenMP) split the rows, each with its own buffer of SEGMENT + 16 M
 * float32; a row's operations do not depend on the split. Returns 0, or -1 when a buffer
 * cannot be allocated. */
#define SEGMENT 1024 /* weights unpacked at a time for several sequences: a multiple of 32 */
int packed_groups_gemv(const packed_groups_t *pw, const float *restrict x, int64_t M,
                       float *restrict y) {
    const void *offset = pw->offset;
    int64_t group = pw->group, rows = pw->rows, K = pw->K;
    int64_t groups = K / group;
    float *xsum = NULL;
    if (offset) {
        xsum = malloc((size_t)(M * groups) * sizeof(float));
        if (!xsum) return -1;
        for (int64_t i = 0; i < M * groups; i++) {
            float total = 0.0f;
            for (int64_t k = 0; k < group; k++) total += x[i * group + k];
            xsum[i] = total;
        }
    }
    int failed = 0;
#pragma omp parallel reduction(| : failed) if (!in_parallel())
    {
    float *work = malloc((size_t)(SEGMENT + 16 * M) * sizeof(float));
    failed = work == NULL;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (!work) continue;
        packed_row_t w = packed_at(pw, r);
#ifdef __AVX2__
        float *state = work + SEGMENT; /* per sequence: 8 lanes of acc, then o */
        if (M == 1) {
            __m256 acc = _mm256_setzero_ps(), f[4];
            float o = 0.0f;
            for (int64_t c = 0; c < K / 32; c++) {
                chunk_vectors(&w, c, f);
                chunk_dot(&w, c, f, x + c * 32, xsum, &acc, &o);
            }
            _mm256_storeu_ps(state, acc);
            state[8] = o;
        } else {
            memset(state, 0, (size_t)(16 * M) * sizeof(float));
            for (int64_t k0 = 0; k0 < K; k0 += SEGMENT) {
                int64_t n = K - k0 < SEGMENT ? K - k0 : SEGMENT;
                for (int64_t i = 0; i < n; i += 32) {
                    __m256 f[4];
                    chunk_vectors(&w, (k0 + i) / 32, f);
                    for (int v = 0; v < 4; v++) _mm256_storeu_ps(work + i + 8 * v, f[v]);
                }
                for (int64_t m = 0; m < M; m++) {
                    __m256 acc = _mm256_loadu_ps(state + 16 * m), f[4];
                    float o = state[16 * m + 8];
                    for (int64_t i = 0; i < n; i += 32) {
                        for (int v = 0; v < 4; v++) f[v] = _mm256_loadu_ps(work + i + 8 * v);
                        chunk_dot(&w, (k0 + i) / 32, f, x + m * K + k0 + i, xsum + m * groups, &acc, &o);
                    }
                    _mm256_storeu_ps(state + 16 * m, acc);
                    state[16 * m + 8] = o;
                }
            }
        }
        for (int64_t m = 0; m < M; m++) {
            float total = 0.0f;
            for (int l = 0; l < 8; l++) total += state[16 * m + l];
            y[m * rows + r] = total + state[16 * m + 8];
        }
#else
        (void)work;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            float acc = 0.0f, o = 0.0f;
            int32_t q[32];
            for (int64_t c = 0; c < K / 32; c++) {
                chunk_ints(&w, c, q);
                for (int64_t g = c * 32 / group; g < (c + 1) * 32 / group; g++) {
                    float part = 0.0f;
                    for (int64_t k = g * group; k < (g + 1) * group; k++)
                        part += (float)(w.offset ? q[k - c * 32] : q[k - c * 32] - w.center) * xm[k];
                    acc += scalar_at(w.scale, g, w.scales_bf16) * part;
                    if (w.offset) o += scalar_at(w.offset, g, w.scales_bf16) * xsum[m * groups + g];
                }
            }
            y[m * rows + r] = acc + o;
        }
#endif
    }
    free(work);
    }
    free(xsum);
    return failed ? -1 : 0;
}

/* AVX-512: a block's chunk of 32 weights of 16 rows is read as 4 + hb 64-byte lines (hb 0
 * for codes) and
 * unpacked into eight registers of 16 rows x 4 weights as bytes (the operand order of
 * vpdpbusd); the transposed dequantization and the int8 product start from there. */
#if defined(__AVX512F__) && defined(__AVX512BW__)

#define AHEAD 32 /* chunks (of a row block; row blocks in the transposed dequantization) read ahead */

/* Asks for a block's chunk (its 256 low bytes at l, 64 hb high bytes at h) to be cached. */
static inline void prefetch_chunk(const uint8_t *l, const uint8_t *h, int hb) {
    for (int line = 0; line < 4; line++) _mm_prefetch((const char *)(l + 64 * line), _MM_HINT_T0);
    for (int line = 0; line < hb; line++) _mm_prefetch((const char *)(h + 64 * line), _MM_HINT_T0);
}

/* A block's chunk of 16 rows (its 256 low bytes at l, 64 hb high bytes at h, in the layout
 * above; or with a codebook, hb 0, codes) as u[j], j < 8: lane i holds row i's weights
 * 4 j .. 4 j + 3, one a byte. */
static inline void chunk_quads(const uint8_t *l, const uint8_t *h, int hb, const uint8_t *codebook,
                               __m512i *u) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    /* dword d of a row's low bytes: weights 4 d .. 4 d + 3 (low nibbles), 16 + 4 d .. (high) */
    __m512i lows[4];
    for (int d = 0; d < 4; d++) lows[d] = _mm512_loadu_si512(l + 64 * d);
    if (codebook) { /* each code's integer, by byte shuffle within each 16-byte lane */
        const __m512i book = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)codebook));
        for (int j = 0; j < 8; j++)
            u[j] = _mm512_shuffle_epi8(book, j < 4 ? _mm512_and_si512(lows[j], nibble)
                                                   : _mm512_and_si512(_mm512_srli_epi16(lows[j - 4], 4), nibble));
    } else if (hb == 2) { /* byte b of 8 holds weights b, b + 8, b + 16, b + 24 in its bit pairs */
        __m512i top[2] = {_mm512_loadu_si512(h), _mm512_loadu_si512(h + 64)};
        const __m512i pair = _mm512_set1_epi8(0x03);
        for (int j = 0; j < 8; j++) { /* weights 4 j + b: byte (4 j + b) % 8, pair j / 2 */
            __m512i t = _mm512_and_si512(_mm512_srli_epi16(top[j & 1], 2 * (j >> 1)), pair);
            __m512i bottom = j < 4 ? _mm512_and_si512(lows[j], nibble)
                                   : _mm512_and_si512(_mm512_srli_epi16(lows[j - 4], 4), nibble);
            u[j] = _mm512_or_si512(bottom, _mm512_slli_epi16(t, 4));
        }
    } else { /* weight i's fifth bit is bit i of the little-endian word */
        __m512i word = _mm512_loadu_si512(h);
        const __m512i spread = _mm512_set1_epi32(0x00204081); /* bit b -> bit 8 b */
        for (int j = 0; j < 8; j++) {
            __m512i bits = _mm512_and_si512(_mm512_srli_epi32(word, 4 * j), _mm512_set1_epi32(0x0F));
            __m512i t = _mm512_and_si512(_mm512_mullo_epi32(bits, spread), _mm512_set1_epi32(0x01010101));
            __m512i bottom = j < 4 ? _mm512_and_si512(lows[j], nibble)
                                   : _mm512_and_si512(_mm512_srli_epi16(lows[j - 4], 4), nibble);
            u[j] = _mm512_or_si512(bottom, _mm512_slli_epi16(t, 4));
        }
    }
}

/* Group g's 16 scales (or offsets) of a block ([groups, 16] from p) as float32. */
static inline __m512 group16(const uint8_t *p, int64_t g, int bf16) {
    if (bf16)
        return from_bf16_16(p + g * 32);
    return _mm512_loadu_ps(p + g * 64);
}

/* A block's chunk (16 rows, 32 weights) dequantized: v[4 j + t] holds weight 4 j + t of
 * each of the 16 rows, as the eager code computes it. */
static inline void chunk_values(const packed_groups_t *w, int64_t b, int64_t c, __m512 *v) {
    packed_block_t at = block_at(w, b);
    __m512i u[8];
    chunk_quads(at.low + c * 256, at.high + c * 64 * w->hb, (int)w->hb, w->codebook, u);
    for (int j = 0; j < 8; j++) {
        int64_t g = (c * 32 + 4 * j) / w->group;
        __m512 s = group16(at.scale, g, w->scales_bf16);
        __m512 o = at.offset ? group16(at.offset, g, w->scales_bf16) : _mm512_setzero_ps();
        for (int t = 0; t < 4; t++) {
            __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(u[j], 8 * t),
                                                           _mm512_set1_epi32(0xFF)));
            v[4 * j + t] = at.offset ? _mm512_add_ps(_mm512_mul_ps(q, s), o)
                                  : _mm512_mul_ps(_mm512_sub_ps(q, _mm512_set1_ps((float)w->center)), s);
        }
    }
}

/* out[k * rows + r] = W[r, k] for all of w's rows (a prefill GEMM's operand, W^T), bfloat16
 * when out_bf16 else float32, each value as the eager code computes it. A store is a whole
 * 64-byte line of out (bfloat16: two blocks' values), written around the caches where
 * out's lines are aligned (non-temporal: a line of out is rows values apart from the
 * next, and reading each line for ownership before writing it took 1.5 ns a weight
 * against 0.4). Threads split the pairs of blocks. */
void packed_groups_cols(const packed_groups_t *w, void *out, int out_bf16) {
    int64_t rows = w->rows, chunks = w->K / 32, blocks = rows / 16, step = out_bf16 ? 2 : 1;
    int aligned = (uintptr_t)out % 64 == 0 && rows % (out_bf16 ? 32 : 16) == 0;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b += step) {
        int pair = out_bf16 && b + 1 < blocks;
        for (int64_t c = 0; c < chunks; c++) {
            __m512 v[32], v2[32];
            chunk_values(w, b, c, v);
            if (pair) chunk_values(w, b + 1, c, v2);
            for (int k = 0; k < 32; k++) {
                int64_t at = (c * 32 + k) * rows + b * 16;
                if (pair) {
                    __m512i line = _mm512_inserti64x4(_mm512_castsi256_si512(bf16_16(v[k])),
                                                      bf16_16(v2[k]), 1);
                    if (aligned) _mm512_stream_si512((void *)((uint16_t *)out + at), line);
                    else _mm512_storeu_si512((uint16_t *)out + at, line);
                } else if (out_bf16) {
                    _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), bf16_16(v[k]));
                } else if (aligned) {
                    _mm512_stream_ps((float *)out + at, v[k]);
                } else {
                    _mm512_storeu_ps((float *)out + at, v[k]);
                }
            }
        }
        _mm_sfence(); /* the non-temporal stores, before the GEMM reads them */
    }
}

#else
void packed_groups_cols(const packed_groups_t *w, void *out, int out_bf16) {
    float *row = malloc((size_t)w->K * sizeof(float));
    if (!row) return;
    for (int64_t r = 0; r < w->rows; r++) {
        packed_groups_rows(w, &r, 1, row, 0, NULL);
        for (int64_t k = 0; k < w->K; k++) {
            if (out_bf16) ((uint16_t *)out)[k * w->rows + r] = to_bf16(row[k]);
            else ((float *)out)[k * w->rows + r] = row[k];
        }
    }
    free(row);
}
#endif

/* The decode product with int8 activations (bfloat16 weights). Each row of x is rounded
 * to int8 groups of 32 (kernels.h's quantize_row: q, d, and X = d times the sum of q over
 * each weight group), and for a weight group of integers u
 * (0 .. 2^bits - 1) with scale s and offset o (o = -center s for the symmetric types:
 * GGUF's Q6_K is d sc (u - 32)):
 *
 *   y[m, r] = sum over groups of  s d P + o X,   P = sum of u q over the group (int32, exact)
 *
 * llama.cpp's quantized dot products have the same structure (ggml-cpu's Q6_K x Q8_K).
 * A block's chunk of 16 rows unpacked (chunk_quads) is multiplied into every row of x
 * (vpdpbusd, u8 by s8, four at a time into int32).
 * A row's sums run in a fixed order whatever the other rows of x, so its result is the
 * same bits in any batch. Threads (OpenMP) split the blocks of 16 rows. */
#if INT4_GEMV_BUILT
/* The product's rows of x q (int8 [M, K]) with their d [M, chunks] and xs [M, groups]. */
typedef struct {
    const int8_t *q;
    const float *d, *xs;
    int64_t M;
} q8_rows_t;

/* Block b's products into acc (16 float32 a row of x). HALVES, the weight groups in a
 * chunk (2 for groups of 16), is a constant after inlining: indexed by a variable, the
 * integer sums p lived in memory and each vpdpbusd waited on the last one's store. One
 * block at a time: two blocks interleaved (sharing each row's loads of x) streamed their
 * weights at 14-16 GB/s on one Zen 4 thread where one block streams 23-25. */
static inline __attribute__((always_inline)) void q8_block(
        const packed_groups_t *w, int64_t b, const int HALVES, const q8_rows_t *x, __m512 *acc) {
    int64_t K = w->K, chunks = K / 32, groups = K / w->group, hb = w->hb;
    packed_block_t at = block_at(w, b);
    for (int64_t m = 0; m < x->M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        __m512i u[8];
        __m512 s[2], o[2];
        if (c + AHEAD < chunks)
            prefetch_chunk(at.low + (c + AHEAD) * 256, at.high + (c + AHEAD) * 64 * hb, (int)hb);
        chunk_quads(at.low + c * 256, at.high + c * 64 * hb, (int)hb, w->codebook, u);
        for (int h = 0; h < HALVES; h++) {
            s[h] = group16(at.scale, c * HALVES + h, w->scales_bf16);
            o[h] = at.offset ? group16(at.offset, c * HALVES + h, w->scales_bf16)
                             : _mm512_mul_ps(_mm512_set1_ps(-(float)w->center), s[h]);
        }
        for (int64_t m = 0; m < x->M; m++) {
            const int8_t *qm = x->q + m * K + c * 32;
            __m512i p[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                int32_t four;
                memcpy(&four, qm + 4 * j, 4);
                const int h = HALVES == 2 && j >= 4;
                p[h] = _mm512_dpbusd_epi32(p[h], u[j], _mm512_set1_epi32(four));
            }
            __m512 a = acc[m], dv = _mm512_set1_ps(x->d[m * chunks + c]);
            for (int h = 0; h < HALVES; h++) {
                a = _mm512_fmadd_ps(_mm512_mul_ps(s[h], dv), _mm512_cvtepi32_ps(p[h]), a);
                a = _mm512_fmadd_ps(o[h], _mm512_set1_ps(x->xs[m * groups + c * HALVES + h]), a);
            }
            acc[m] = a;
        }
    }
}

int packed_groups_q8_gemv(const packed_groups_t *w, const void *x, int x_f32, int64_t M,
                          float *y) {
    int64_t K = w->K, rows = w->rows, chunks = K / 32, groups = K / w->group, blocks = rows / 16;
    if (M <= 0 || rows <= 0) return 0;
    size_t bytes = (size_t)(M * K + (M * chunks + M * groups) * 4 + 63) / 64 * 64;
    int8_t *q = aligned_alloc(64, bytes);
    if (!q) return -1;
    float *d = (float *)(q + M * K), *xs = d + M * chunks;
    for (int64_t m = 0; m < M; m++)
        quantize_row((const char *)x + m * K * (x_f32 ? 4 : 2), x_f32, K, w->group, q + m * K,
                     d + m * chunks, xs + m * groups);
    q8_rows_t rows_of_x = {q, d, xs, M};
    int failed = 0;
#pragma omp parallel reduction(| : failed) if (!in_parallel())
    {
    __m512 *acc = aligned_alloc(64, (size_t)M * sizeof(__m512));
    failed = acc == NULL;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        if (!acc) continue;
        if (w->group == 16) q8_block(w, b, 2, &rows_of_x, acc);
        else q8_block(w, b, 1, &rows_of_x, acc);
        for (int64_t m = 0; m < M; m++) _mm512_storeu_ps(y + m * rows + b * 16, acc[m]);
    }
    free(acc);
    }
    free(q);
    return failed ? -1 : 0;
}
#else /* not built: native_dequant.py calls it only where int4_planes_gemv_built() */

int packed_groups_q8_gemv(const packed_groups_t *w, const void *x, int x_f32, int64_t M,
                          float *y) {
    (void)w, (void)x, (void)x_f32, (void)M, (void)y;
    return -1;
}
#endif
