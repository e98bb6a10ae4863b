/* Dequantization of shardline's resident weights into a compute-dtype scratch block, one
 * pass over the packed bytes (see shardline/models/native_dequant.py, which compiles and
 * loads this file, and shardline/models/linear.py, whose eager torch code computes the same
 * values and is the reference).
 *
 * Every value is computed in float32 as (p * scale + zero) with no fused multiply-add
 * (built with -ffp-contract=off), summed over the planes, and rounded once to the output
 * dtype: bit for bit what the eager code computes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* torch's CPU int4 layout (torch._convert_weight_to_int4pack_for_cpu) for blocks of
 * 2 * HALF rows, "halves" order: a plane is [out / (2 HALF), K, HALF] bytes, and byte j of
 * a block's column k holds row j (low nibble) and row j + HALF (high nibble). Its scales
 * and zeros are bfloat16 [K / 32, out, 2]: w = (p - 8) * scale + zero.
 *
 * Writes rows [r0, r0 + rows) of W as W^T: out[k * rows + r] for k < K, r < rows, where
 * W is the sum over the planes (one, or two when p1 is not NULL); r0 and rows are
 * multiples of 2 * HALF; p0 and p1 point at the planes' first byte, sz0 and sz1 at their
 * scales. */
#define INT4_KERNEL(HALF)                                                                   \
    static inline void int4_plane_##HALF(const uint8_t *restrict a, const float *restrict s,  \
                                         const float *restrict z, float *restrict t,          \
                                         int add) {                                           \
        if (add) {                                                                           \
            for (int j = 0; j < HALF; j++) {                                                 \
                t[j] += (float)(a[j] & 15) * s[j] + z[j];                                    \
                t[j + HALF] += (float)(a[j] >> 4) * s[j + HALF] + z[j + HALF];               \
            }                                                                                \
        } else {                                                                             \
            for (int j = 0; j < HALF; j++) {                                                 \
                t[j] = (float)(a[j] & 15) * s[j] + z[j];                                     \
                t[j + HALF] = (float)(a[j] >> 4) * s[j + HALF] + z[j + HALF];                \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    void int4_planes_t_##HALF(const uint8_t *p0, const uint16_t *sz0, const uint8_t *p1,    \
                              const uint16_t *sz1, int64_t out_features, int64_t r0,          \
                              int64_t rows, int64_t K, void *out, int bf16) {                \
        float t[2 * HALF] __attribute__((aligned(64)));                                      \
        float s[2][2 * HALF], z[2][2 * HALF];                                                \
        const uint8_t *planes[2] = {p0, p1};                                                 \
        const uint16_t *scales[2] = {sz0, sz1};                                              \
        int count = p1 ? 2 : 1;                                                              \
        for (int64_t b = 0; b < rows / (2 * HALF); b++) {                                    \
            int64_t row = r0 + b * 2 * HALF;                                                 \
            for (int64_t g = 0; g < K / 32; g++) {                                           \
                for (int i = 0; i < count; i++) {                                            \
                    const uint16_t *sz = scales[i] + (g * out_features + row) * 2;           \
                    for (int j = 0; j < 2 * HALF; j++) {                                     \
                        s[i][j] = from_bf16(sz[2 * j]);                                      \
                        z[i][j] = from_bf16(sz[2 * j + 1]) - 8 * s[i][j];                    \
                    }                                                                        \
                }                                                                            \
                for (int64_t k = g * 32; k < g * 32 + 32; k++) {                             \
                    for (int i = 0; i < count; i++)                                          \
                        int4_plane_##HALF(planes[i] + (b * K + k) * HALF, s[i], z[i], t, i);  \
                    int64_t o = k * rows + b * 2 * HALF;                                     \
                    if (bf16) {                                                              \
                        uint16_t *restrict d = (uint16_t *)out + o;                          \
                        for (int j = 0; j < 2 * HALF; j++) d[j] = to_bf16(t[j]);             \
                    } else {                                                                 \
                        float *restrict d = (float *)out + o;                                \
                        for (int j = 0; j < 2 * HALF; j++) d[j] = t[j];                      \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }

INT4_KERNEL(16)
#if defined(__AVX512F__) && defined(__AVX512BW__)
/* int4_planes_t_32 with AVX-512 and threads: the same float32 operations on 16 rows at a
 * time (a product and a sum, no fused multiply-add; to_bf16's rounding in integers), so
 * the same bits. */
void int4_planes_t_32(const uint8_t *p0, const uint16_t *sz0, const uint8_t *p1,
                      const uint16_t *sz1, int64_t out_features, int64_t r0, int64_t rows,
                      int64_t K, void *out, int bf16) {
    const uint8_t *planes[2] = {p0, p1};
    const uint16_t *scales[2] = {sz0, sz1};
    int count = p1 ? 2 : 1;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < rows / 64; b++) {
        int64_t row = r0 + b * 64;
        for (int64_t g = 0; g < K / 32; g++) {
            __m512 s[2][4], z[2][4];
            for (int i = 0; i < count; i++)
                for (int j = 0; j < 4; j++) /* (scale, zero) pairs of 16 rows */
                    plane_scale_zero_16(scales[i] + (g * out_features + row + 16 * j) * 2, &s[i][j], &z[i][j]);
            for (int64_t k = g * 32; k < g * 32 + 32; k++) {
                __m512 t[4];
                block_column_64(planes[0] + (b * K + k) * 32, p1 ? p1 + (b * K + k) * 32 : NULL, s, z, t);
                int64_t o = k * rows + b * 64;
                for (int j = 0; j < 4; j++) {
                    if (bf16)
                        _mm256_storeu_si256((__m256i *)((uint16_t *)out + o + 16 * j), bf16_16(t[j]));
                    else
                        _mm512_storeu_ps((float *)out + o + 16 * j, t[j]);
                }
            }
        }
    }
}
#else
INT4_KERNEL(32)
#endif

/* Rows ids[0 .. n) of W, the sum of one or two int4 planes (p1, sz1 NULL for one) in
 * torch's CPU layout of blocks of `block` rows in any nibble order: a plane is
 * [out / block, K, block / 2] bytes, and a block's row r is nibble position[r] of its
 * column's bytes (byte position / 2, the high nibble where it is odd); scales and zeros
 * bfloat16 [K / 32, out, 2]. Writes float32 out[i * K + k] = the planes' (p - 8) * scale
 * + zero summed in plane order, in float32 without fused multiply-adds: the values
 * Int4Planes.embed's torch ops compute (shardline/models/int4_planes.py), bit for bit.
 * For embedding lookups and the LM head's refined logits, a few rows at a time (each row
 * reads one byte in 32 of its planes' memory: threads take rows from 16 on). */
void int4_planes_rows(const uint8_t *p0, const uint16_t *sz0, const uint8_t *p1,
                      const uint16_t *sz1, int64_t out_features, int64_t K, int64_t block,
                      const int64_t *position, const int64_t *ids, int64_t n, float *out) {
    int64_t half = block / 2;
    const uint8_t *planes[2] = {p0, p1};
    const uint16_t *scales[2] = {sz0, sz1};
    int count = p1 ? 2 : 1;
#pragma omp parallel for schedule(static) if (n >= 16)
    for (int64_t i = 0; i < n; i++) {
        int64_t id = ids[i], pos = position[id % block];
        int shift = 4 * (int)(pos % 2);
        float *restrict o = out + i * K;
        for (int plane = 0; plane < count; plane++) {
            const uint8_t *restrict a = planes[plane] + (id / block) * K * half + pos / 2;
            const uint16_t *sz = scales[plane];
            for (int64_t g = 0; g < K / 32; g++) {
                float s = from_bf16(sz[(g * out_features + id) * 2]);
                float z = from_bf16(sz[(g * out_features + id) * 2 + 1]);
                for (int64_t k = g * 32; k < g * 32 + 32; k++) {
                    float v = ((float)((a[k * half] >> shift) & 15) - 8.0f) * s + z;
                    o[k] = plane ? o[k] + v : v;
                }
            }
        }
    }
}

/* One byte a weight: q uint8 [rows, K], scale and offset float32 [rows, K / group].
 * Writes W row-major: out[r * K + k] = q * scale + offset. */
void int8_groups(const uint8_t *restrict q, const float *restrict scale,
                 const float *restrict offset, int64_t rows, int64_t K, int64_t group,
                 void *out, int bf16) {
    int64_t groups = K / group;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *restrict a = q + r * K + g * group;
            float s = scale[r * groups + g], o = offset[r * groups + g];
            if (bf16) {
                uint16_t *restrict d = (uint16_t *)out + r * K + g * group;
                for (int64_t j = 0; j < group; j++) d[j] = to_bf16((float)a[j] * s + o);
            } else {
                float *restrict d = (float *)out + r * K + g * group;
                for (int64_t j = 0; j < group; j++) d[j] = (float)a[j] * s + o;
            }
        }
    }
}

/* Adds s * q[j] * x[j] for j < n (a multiple of 8) into 8 float32 lanes (lane j % 8). */
static inline void dot_u8_f32(const uint8_t *restrict q, const float *restrict x, int64_t n,
                               float s, float *restrict lanes) {
#ifdef __AVX2__
    __m256 acc = _mm256_loadu_ps(lanes);
    __m256 sv = _mm256_set1_ps(s);
    for (int64_t j = 0; j < n; j += 8) {
        __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + j))));
        acc = _mm256_add_ps(acc, _mm256_mul_ps(sv, _mm256_mul_ps(qf, _mm256_loadu_ps(x + j))));
    }
    _mm256_storeu_ps(lanes, acc);
#else
    for (int64_t j = 0; j < n; j += 8)
        for (int l = 0; l < 8; l++) lanes[l] += s * ((float)q[j + l] * x[j + l]);
#endif
}

/* A product of few rows with int8 groups, without dequantizing the weight (decode):
 * y[m * rows + r] = sum over k of scale[r, g(k)] * q[r, k] * x[m, k], plus sum over
 * groups g of offset[r, g] * xsum[m * groups + g], for x float32 [M, K] and xsum float32
 * [M, K / group] (each group's sum of x), accumulated in 8 float32 lanes. Each output is computed on its own, so a row's result does not
 * depend on the other rows of x. group is a multiple of 8. */
void int8_groups_gemv(const uint8_t *restrict q, const float *restrict scale,
                      const float *restrict offset, int64_t rows, int64_t K, int64_t group,
                      const float *restrict x, const float *restrict xsum, int64_t M,
                      float *restrict y) {
    int64_t groups = K / group;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *restrict qr = q + r * K;
        for (int64_t m = 0; m < M; m++) {
            const float *restrict xm = x + m * K;
            float lanes[8] = {0};
            float total = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                dot_u8_f32(qr + g * group, xm + g * group, group, scale[r * groups + g], lanes);
                total += offset[r * groups + g] * xsum[m * groups + g];
            }
            for (int l = 0; l < 8; l++) total += lanes[l];
            y[m * rows + r] = total;
        }
    }
}
