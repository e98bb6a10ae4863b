/* The decode product of packed 5- and 6-bit groups with int8 activations (see
 * shardline/models/native_dequant.py, packed_groups_gemv, which calls it for bfloat16
 * weights, and decode_layer.c, whose fused layers call it; dequant.c describes the layout
 * and holds the float32 product that float32 weights take).
 *
 * Each row of x is rounded to int8 groups of 32 (kernels.h's quantize_row: q, d, and X =
 * d times the sum of q over each weight group), and for a weight group of integers u
 * (0 .. 2^bits - 1) with scale s and offset o (o = -center s for the symmetric types:
 * GGUF's Q6_K is d sc (u - 32)):
 *
 *   y[m, r] = sum over groups of  s d P + o X,   P = sum of u q over the group (int32, exact)
 *
 * llama.cpp's quantized dot products have the same structure (ggml-cpu's Q6_K x Q8_K).
 * The weight's rows are laid out in blocks of 16 (dequant.c): a block's chunk of 32 weights
 * is read as 4 + hb registers and unpacked into eight of 16 rows x 4 weights as bytes (the
 * operand order of vpdpbusd, u8 by s8, four at a time into int32), multiplied into every
 * row of x.
 * A row's sums run in a fixed order whatever the other rows of x, so its result is the
 * same bits in any batch. Threads (OpenMP) split the blocks of 16 rows. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"

#if INT4_GEMV_BUILT

#define AHEAD 8 /* chunks read ahead */

/* Chunk c of a block of 16 rows (low, high: the block's chunk 0, dequant.c's layout) as
 * u[j], j < 8: lane i holds row i's weights 4 j .. 4 j + 3, one a byte. */
static inline void chunk_quads(const uint8_t *low, const uint8_t *high, int hb, int64_t c,
                               __m512i *u) {
    const uint8_t *l = low + c * 256, *h = high + c * 64 * hb;
    _mm_prefetch((const char *)(l + AHEAD * 256), _MM_HINT_T0);
    for (int line = 1; line < 4; line++)
        _mm_prefetch((const char *)(l + AHEAD * 256 + 64 * line), _MM_HINT_T0);
    for (int line = 0; line < hb; line++)
        _mm_prefetch((const char *)(h + AHEAD * 64 * hb + 64 * line), _MM_HINT_T0);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    /* dword d of a row's low bytes: weights 4 d .. 4 d + 3 (low nibbles), 16 + 4 d .. (high) */
    __m512i lows[4];
    for (int d = 0; d < 4; d++) lows[d] = _mm512_loadu_si512(l + 64 * d);
    if (hb == 2) { /* byte b of 8 holds weights b, b + 8, b + 16, b + 24 in its bit pairs */
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
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + g * 32))), 16));
    return _mm512_loadu_ps(p + g * 64);
}

int packed_groups_q8_gemv(const packed_groups_t *w, const void *x, int x_f32, int64_t M,
                          float *y) {
    int64_t K = w->K, rows = w->rows, chunks = K / 32, groups = K / w->group;
    if (M <= 0 || rows <= 0) return 0;
    size_t bytes = (size_t)(M * K + (M * chunks + M * groups) * 4 + 63) / 64 * 64;
    int8_t *q = aligned_alloc(64, bytes);
    if (!q) return -1;
    float *d = (float *)(q + M * K), *xs = d + M * chunks;
    for (int64_t m = 0; m < M; m++)
        quantize_row((const char *)x + m * K * (x_f32 ? 4 : 2), x_f32, K, w->group, q + m * K,
                     d + m * chunks, xs + m * groups);
    int size = w->scales_bf16 ? 2 : 4, failed = 0;
#pragma omp parallel reduction(| : failed)
    {
    __m512 *acc = aligned_alloc(64, (size_t)M * sizeof(__m512));
    failed = acc == NULL;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < rows / 16; b++) {
        if (!acc) continue;
        const uint8_t *low = w->low + b * chunks * 256, *high = w->high + b * chunks * 64 * w->hb;
        const uint8_t *scale = (const uint8_t *)w->scale + b * groups * 16 * size;
        const uint8_t *offset = w->offset ? (const uint8_t *)w->offset + b * groups * 16 * size : NULL;
        for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; c++) {
            __m512i u[8];
            chunk_quads(low, high, (int)w->hb, c, u);
            int halves = w->group == 16 ? 2 : 1; /* weight groups in the chunk */
            __m512 s[2], o[2];
            for (int h = 0; h < halves; h++) {
                int64_t g = c * halves + h;
                s[h] = group16(scale, g, w->scales_bf16);
                o[h] = offset ? group16(offset, g, w->scales_bf16)
                              : _mm512_mul_ps(_mm512_set1_ps(-(float)w->center), s[h]);
            }
            for (int64_t m = 0; m < M; m++) {
                const int8_t *qm = q + m * K + c * 32;
                __m512i p[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
                for (int j = 0; j < 8; j++) {
                    int32_t four;
                    memcpy(&four, qm + 4 * j, 4);
                    __m512i *pj = p + (halves == 2 && j >= 4);
                    *pj = _mm512_dpbusd_epi32(*pj, u[j], _mm512_set1_epi32(four));
                }
                __m512 dv = _mm512_set1_ps(d[m * chunks + c]), a = acc[m];
                for (int h = 0; h < halves; h++) {
                    a = _mm512_fmadd_ps(_mm512_mul_ps(s[h], dv), _mm512_cvtepi32_ps(p[h]), a);
                    a = _mm512_fmadd_ps(o[h], _mm512_set1_ps(xs[m * groups + c * halves + h]), a);
                }
                acc[m] = a;
            }
        }
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
