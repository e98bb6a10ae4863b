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

INT4_KERNEL(32)
INT4_KERNEL(16)

/* Rows ids[0 .. n) of W, the sum of one or two int4 planes (p1, sz1 NULL for one) in
 * torch's CPU layout of blocks of `block` rows in any nibble order: a plane is
 * [out / block, K, block / 2] bytes, and a block's row r is nibble position[r] of its
 * column's bytes (byte position / 2, the high nibble where it is odd); scales and zeros
 * bfloat16 [K / 32, out, 2]. Writes float32 out[i * K + k] = the planes' (p - 8) * scale
 * + zero summed in plane order, in float32 without fused multiply-adds: the values
 * Int4Planes.embed's torch ops compute (shardline/models/int4_planes.py), bit for bit.
 * For embedding lookups and the LM head's refined logits, a few rows at a time. */
void int4_planes_rows(const uint8_t *p0, const uint16_t *sz0, const uint8_t *p1,
                      const uint16_t *sz1, int64_t out_features, int64_t K, int64_t block,
                      const int64_t *position, const int64_t *ids, int64_t n, float *out) {
    int64_t half = block / 2;
    const uint8_t *planes[2] = {p0, p1};
    const uint16_t *scales[2] = {sz0, sz1};
    int count = p1 ? 2 : 1;
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

/* 5- or 6-bit integer groups split into a nibble plane and a high-bit plane
 * (shardline/models/packed_groups.py). A row is a run of 32-weight chunks; chunk c has
 * 16 bytes of low nibbles at low[16 c] (byte j: weight j in the low nibble, weight j + 16
 * in the high one) and 4 hb bytes of high bits at high[4 hb c], hb = bits - 4: for hb = 2,
 * byte j (< 8) holds weights j, j + 8, j + 16, j + 24 in bits 0-1, 2-3, 4-5, 6-7; for
 * hb = 1, weight i's bit is bit i of the little-endian 32-bit word. scale, and offset
 * where it is not NULL, hold one value per group of `group` weights (16 or 32), bfloat16
 * when scales_bf16 else float32: w = q * scale + offset, or (q - center) * scale without
 * one (the form of GGUF's symmetric types, e.g. Q6_K's d * sc * (q - 32)). */
typedef struct {
    const uint8_t *low, *high;
    const void *scale, *offset;
    int center, hb, scales_bf16;
    int64_t group, K;
} packed_row_t;

static inline float scalar_at(const void *p, int64_t i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline packed_row_t packed_at(packed_row_t w, int64_t r) {
    int64_t groups = w.K / w.group, size = w.scales_bf16 ? 2 : 4;
    w.low += r * w.K / 2;
    w.high += r * w.K * w.hb / 8;
    w.scale = (const char *)w.scale + r * groups * size;
    if (w.offset) w.offset = (const char *)w.offset + r * groups * size;
    return w;
}

/* Chunk c's 32 integers (0 .. 2^bits - 1). */
static inline void chunk_ints(const packed_row_t *w, int64_t c, int32_t *restrict q) {
    const uint8_t *l = w->low + c * 16, *h = w->high + c * 4 * w->hb;
    for (int j = 0; j < 16; j++) {
        q[j] = l[j] & 15;
        q[j + 16] = l[j] >> 4;
    }
    if (w->hb == 2) {
        for (int j = 0; j < 8; j++)
            for (int part = 0; part < 4; part++) q[j + 8 * part] |= ((h[j] >> (2 * part)) & 3) << 4;
    } else {
        for (int i = 0; i < 32; i++) q[i] |= ((h[i / 8] >> (i % 8)) & 1) << 4;
    }
}

/* Writes rows [0, rows) row-major into out (bfloat16 when out_bf16, else float32), each
 * value computed in float32 without fused multiply-adds; the pointers are at the first
 * row; work is float32 [K]. */
void packed_groups_rows(const uint8_t *low, const uint8_t *high, const void *scale,
                        const void *offset, int center, int hb, int64_t group, int64_t rows,
                        int64_t K, int scales_bf16, void *out, int out_bf16, float *work) {
    packed_row_t first = {low, high, scale, offset, center, hb, scales_bf16, group, K};
    for (int64_t r = 0; r < rows; r++) {
        packed_row_t w = packed_at(first, r);
        float *d = out_bf16 ? work : (float *)out + r * K;
        int32_t q[32];
        for (int64_t c = 0; c < K / 32; c++) {
            chunk_ints(&w, c, q);
            for (int j0 = 0; j0 < 32; j0 += (int)group) {
                int64_t g = (c * 32 + j0) / group;
                float s = scalar_at(w.scale, g, scales_bf16);
                float *restrict dg = d + c * 32 + j0;
                if (w.offset) {
                    float o = scalar_at(w.offset, g, scales_bf16);
                    for (int j = 0; j < group; j++) dg[j] = (float)q[j0 + j] * s + o;
                } else {
                    for (int j = 0; j < group; j++) dg[j] = (float)(q[j0 + j] - center) * s;
                }
            }
        }
        if (out_bf16) {
            uint16_t *restrict o = (uint16_t *)out + r * K;
            for (int64_t k = 0; k < K; k++) o[k] = to_bf16(d[k]);
        }
    }
}

/* The decode product. For each group, g = the sum over its weights of q' * x (q' = q -
 * center, or q with an offset) in 8 float32 lanes, then acc += scale * g (lane-wise), and
 * with an offset o += offset * (the group's sum of x, xsum); the output is acc's lanes
 * summed, plus o. One sequence takes its products as a chunk is unpacked; more take them
 * from the chunk's values unpacked once into float32 work (the same operations in the
 * same order: an output does not depend on the other rows of x). */
#ifdef __AVX2__
/* Chunk c's 32 integers q' as four float32 vectors (weights 0-7, 8-15, 16-23, 24-31). */
static inline void chunk_vectors(const packed_row_t *w, int64_t c, __m256 *f) {
    const __m128i m4 = _mm_set1_epi8(15);
    __m128i lb = _mm_loadu_si128((const __m128i *)(w->low + c * 16));
    __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(lb, 4), m4), _mm_and_si128(lb, m4));
    __m256i hi;
    if (w->hb == 2) {
        int64_t h;
        memcpy(&h, w->high + c * 8, 8);
        hi = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(h), _mm256_setr_epi64x(0, 2, 4, 6)),
                              _mm256_set1_epi8(3));
    } else {
        int32_t h;
        memcpy(&h, w->high + c * 4, 4);
        const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        const __m256i bits = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
        __m256i hv = _mm256_shuffle_epi8(_mm256_set1_epi32(h), spread);
        hi = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hv, bits), bits), _mm256_set1_epi8(1));
    }
    __m256i q = _mm256_or_si256(nib, _mm256_slli_epi16(hi, 4));
    __m128i lo128, hi128;
    if (w->offset) {
        lo128 = _mm256_castsi256_si128(q);
        hi128 = _mm256_extracti128_si256(q, 1);
        f[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo128));
        f[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo128, 8)));
        f[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi128));
        f[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi128, 8)));
    } else {
        q = _mm256_sub_epi8(q, _mm256_set1_epi8((char)w->center));
        lo128 = _mm256_castsi256_si128(q);
        hi128 = _mm256_extracti128_si256(q, 1);
        f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo128));
        f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo128, 8)));
        f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi128));
        f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi128, 8)));
    }
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

/* y[m * rows + r] = sum over k of W[r, k] * x[m, k] for x float32 [M, K] with xsum float32
 * [M, K / group] (each group's sum of x; read only with offsets); work holds
 * PACKED_SEGMENT + 16 M float32. */
#define SEGMENT 1024 /* weights unpacked at a time for several sequences: a multiple of 32 */
void packed_groups_gemv(const uint8_t *low, const uint8_t *high, const void *scale,
                        const void *offset, int center, int hb, int64_t group, int64_t rows,
                        int64_t K, int scales_bf16, const float *restrict x,
                        const float *restrict xsum, int64_t M, float *restrict y,
                        float *restrict work) {
    packed_row_t first = {low, high, scale, offset, center, hb, scales_bf16, group, K};
    int64_t groups = K / group;
    for (int64_t r = 0; r < rows; r++) {
        packed_row_t w = packed_at(first, r);
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
                        part += (float)(w.offset ? q[k - c * 32] : q[k - c * 32] - center) * xm[k];
                    acc += scalar_at(w.scale, g, scales_bf16) * part;
                    if (w.offset) o += scalar_at(w.offset, g, scales_bf16) * xsum[m * groups + g];
                }
            }
            y[m * rows + r] = acc + o;
        }
#endif
    }
}

/* The decode product of one or two int4 planes (torch's CPU layout, blocks of 64 rows,
 * "halves" order: byte j of a block's column k holds row j low and row j + 32 high;
 * bfloat16 scales and zeros [K / 32, N, 2], w = (p - 8) * scale + zero; a second plane's
 * scales are 16 times the first's, as shardline/models/int4_planes.py packs 8-bit types)
 * with M rows of activations, for AVX-512 with BF16 and VBMI:
 *
 *   y[m, n] = sum over groups g of  s * P + Z * X,
 *   P = sum over the group's k of (16 + p[n, k]) * x[m, k]               one plane,
 *       sum over the group's k of (16 + p + 16 (16 + p')) * x[m, k]      two planes,
 *   X = the group's sum of x[m, k],  Z = z - 24 s,  or z + z' - 408 s,
 *
 * with s, z the first plane's scale and zero and z' the second's zero, all in float32.
 * 16 + p is exact in bfloat16 (bits 0x4180 | p << 3), and 16 (16 + p') too (0x4380 |
 * p' << 3), so the nibbles become bfloat16 operands with one byte permutation and no
 * lookup, every product is exact, and both planes add into one sum. x is `terms`
 * bfloat16 rows per activation row ([M, terms, K]: 1 for bfloat16 activations; 3 for
 * float32 ones, split so that their sum is the float32 value), all summed into the same
 * P. Each weight group is unpacked once per step into a few KiB of L1 and multiplied
 * into every row; a row's operations and their order do not depend on M or on the other
 * rows, so its result does not either (the unit tests check bit equality). Threads
 * (OpenMP: torch's own runtime, already loaded) split the blocks of 64 output rows. */
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
int int4_planes_gemv_built(void) { return 1; }

/* Plane column pair (k, k + 1) of a 64-row block (64 bytes at a) as four bfloat16-pair
 * vectors: w[j] lane i = (e (16 + p[16 j + i, k]), e (16 + p[16 j + i, k + 1])), e = 1
 * when top is 0x41, 16 when it is 0x43 (the bfloat16's high byte). */
static inline void pair_operands(const uint8_t *a, char top_byte, __m512i *w) {
    const __m512i idx0 = _mm512_set_epi8(
        64, 47, 64, 15, 64, 46, 64, 14, 64, 45, 64, 13, 64, 44, 64, 12,
        64, 43, 64, 11, 64, 42, 64, 10, 64, 41, 64, 9, 64, 40, 64, 8,
        64, 39, 64, 7, 64, 38, 64, 6, 64, 37, 64, 5, 64, 36, 64, 4,
        64, 35, 64, 3, 64, 34, 64, 2, 64, 33, 64, 1, 64, 32, 64, 0);
    const __m512i idx1 = _mm512_add_epi8(idx0, _mm512_set1_epi32(0x00100010));
    const __m512i top = _mm512_set1_epi8(top_byte);
    const __m512i nib = _mm512_set1_epi8(0x78), bit7 = _mm512_set1_epi8((char)0x80);
    __m512i v = _mm512_loadu_si512(a);
    /* (v << 3) & 0x78 | 0x80 per byte: the low nibble as the operand's low byte */
    __m512i lo = _mm512_ternarylogic_epi32(_mm512_slli_epi16(v, 3), nib, bit7, 0xEA);
    __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 1), nib, bit7, 0xEA);
    w[0] = _mm512_permutex2var_epi8(lo, idx0, top);
    w[1] = _mm512_permutex2var_epi8(lo, idx1, top);
    w[2] = _mm512_permutex2var_epi8(hi, idx0, top);
    w[3] = _mm512_permutex2var_epi8(hi, idx1, top);
}

#define AHEAD 1 /* groups read ahead */

/* Group g of block b: the planes' operands (count * 16 pairs of pair_operands) and, per
 * 16 outputs, s and Z in float32. */
static inline void group_operands(const uint8_t **planes, const uint16_t **scales, int count,
                                  int64_t b, int64_t g, int64_t N, int64_t K,
                                  __m512i (*w)[4], __m512 *s, __m512 *Z) {
    for (int i = 0; i < count; i++) {
        if (g + AHEAD < K / 32) { /* the next group (its scales are N * 4 bytes on) */
            const char *later = (const char *)(planes[i] + (b * K + (g + AHEAD) * 32) * 32);
            for (int line = 0; line < 16; line++) _mm_prefetch(later + 64 * line, _MM_HINT_T0);
            later = (const char *)(scales[i] + ((g + AHEAD) * N + b * 64) * 2);
            for (int line = 0; line < 4; line++) _mm_prefetch(later + 64 * line, _MM_HINT_T0);
        }
        for (int pair = 0; pair < 16; pair++)
            pair_operands(planes[i] + (b * K + g * 32 + 2 * pair) * 32, i ? 0x43 : 0x41,
                          w[16 * i + pair]);
    }
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int j = 0; j < 4; j++) { /* lanes (scale, zero): bfloat16 to float32 */
        __m512i both = _mm512_loadu_si512(scales[0] + (g * N + b * 64 + 16 * j) * 2);
        s[j] = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
        __m512 z = _mm512_castsi512_ps(_mm512_and_si512(both, high));
        if (count == 2) {
            __m512i other = _mm512_loadu_si512(scales[1] + (g * N + b * 64 + 16 * j) * 2);
            z = _mm512_add_ps(z, _mm512_castsi512_ps(_mm512_and_si512(other, high)));
        }
        Z[j] = _mm512_sub_ps(z, _mm512_mul_ps(_mm512_set1_ps(count == 2 ? 408.0f : 24.0f), s[j]));
    }
}

/* acc row += s * P + Z * xs for the 64 outputs of a block (P: 64 float32, as 4 vectors). */
static inline void scale_into(float *am, const __m512 *P, const __m512 *s, const __m512 *Z,
                              float xs) {
    __m512 xv = _mm512_set1_ps(xs);
    for (int j = 0; j < 4; j++) {
        __m512 a = _mm512_fmadd_ps(s[j], P[j], _mm512_load_ps(am + 16 * j));
        _mm512_store_ps(am + 16 * j, _mm512_fmadd_ps(Z[j], xv, a));
    }
}

/* Group g's products for rows [m, m + rows) (rows 1 or 2, a constant after inlining):
 * each row's sums take the same operations in the same order either way. */
static inline __attribute__((always_inline)) void group_rows(
        __m512i (*w)[4], const __m512 *s, const __m512 *Z, int count, const uint16_t *x,
        const float *xsum, float *acc, int64_t m, int rows, int64_t terms, int64_t K,
        int64_t groups, int64_t g) {
    __m512 part[2][8];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 8; j++) part[r][j] = _mm512_setzero_ps();
    for (int i = 0; i < count; i++) {
        for (int64_t t = 0; t < terms; t++) {
#pragma GCC unroll 16
            for (int pair = 0; pair < 16; pair++) {
                __m512bh xb[2];
#pragma GCC unroll 2
                for (int r = 0; r < rows; r++) {
                    uint32_t two;
                    memcpy(&two, x + ((m + r) * terms + t) * K + g * 32 + 2 * pair, 4);
                    xb[r] = (__m512bh)_mm512_set1_epi32((int)two);
                }
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    __m512bh wj = (__m512bh)w[16 * i + pair][j];
#pragma GCC unroll 2
                    for (int r = 0; r < rows; r++)
                        part[r][(pair & 1) * 4 + j] =
                            _mm512_dpbf16_ps(part[r][(pair & 1) * 4 + j], wj, xb[r]);
                }
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        __m512 P[4];
        for (int j = 0; j < 4; j++) P[j] = _mm512_add_ps(part[r][j], part[r][4 + j]);
        scale_into(acc + (m + r) * 64, P, s, Z, xsum[(m + r) * groups + g]);
    }
}

static inline void store_rows(const float *acc, int64_t M, int64_t N, int64_t b, void *y,
                              int y_bf16) {
    for (int64_t m = 0; m < M; m++) {
        if (y_bf16) {
            uint16_t *d = (uint16_t *)y + m * N + b * 64;
            for (int j = 0; j < 64; j++) d[j] = to_bf16(acc[m * 64 + j]);
        } else {
            memcpy((float *)y + m * N + b * 64, acc + m * 64, 64 * sizeof(float));
        }
    }
}

/* The vector path: vdpbf16ps, two rows at a time. */
static void gemv_vector(const uint8_t **planes, const uint16_t **scales, int count, int64_t N,
                        int64_t K, const uint16_t *x, int64_t M, int64_t terms,
                        const float *xsum, void *y, int y_bf16) {
    int64_t groups = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < N / 64; b++) {
        float acc[64 * 64] __attribute__((aligned(64)));
        __m512i w[32][4];
        for (int64_t i = 0; i < M * 64; i++) acc[i] = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            __m512 s[4], Z[4];
            group_operands(planes, scales, count, b, g, N, K, w, s, Z);
            int64_t m = 0;
            for (; m + 2 <= M; m += 2) /* two rows at a time: more independent sums */
                group_rows(w, s, Z, count, x, xsum, acc, m, 2, terms, K, groups, g);
            if (m < M)
                group_rows(w, s, Z, count, x, xsum, acc, m, 1, terms, K, groups, g);
        }
        store_rows(acc, M, N, b, y, y_bf16);
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

/* Whether this process may use AMX tiles (Linux asks each process to request them). */
static int amx_allowed(void) {
    static int state; /* 0 unknown, 1 yes, -1 no */
    if (!state) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
    return state == 1;
}

/* The AMX path: per group, tdpbf16ps of a tile of activation rows (`tile` rows of whole
 * rows' terms: 16 or 15, fewer when M is smaller) with the group's operand tiles of 16
 * outputs; each output element is its own sum, so a row's result does not depend on the
 * other rows of its tile or on how many there are. x has its rows padded with zeros to
 * a multiple of 16 / terms * terms. */
static void gemv_amx(const uint8_t **planes, const uint16_t **scales, int count, int64_t N,
                     int64_t K, const uint16_t *x, int64_t M, int64_t terms,
                     const float *xsum, void *y, int y_bf16) {
    int64_t groups = K / 32, tile = 16 / terms * terms;
    if (M * terms < tile) tile = M * terms; /* fewer rows: a smaller tile */
    int64_t per = tile / terms, tiles = (M + per - 1) / per;
#pragma omp parallel
    {
        struct {
            uint8_t palette, start;
            uint8_t pad[14];
            uint16_t colsb[16];
            uint8_t rows[16];
        } __attribute__((aligned(64))) cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 7; t++) {
            cfg.colsb[t] = 64;
            cfg.rows[t] = t < 5 ? (uint8_t)tile : 16; /* C 0-3, A 4: rows; B 5, 6: pairs */
        }
        _tile_loadconfig(&cfg);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < N / 64; b++) {
            float acc[64 * 64] __attribute__((aligned(64)));
            float c[16 * 64] __attribute__((aligned(64)));
            __m512i w[32][4];
            for (int64_t i = 0; i < M * 64; i++) acc[i] = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                __m512 s[4], Z[4];
                group_operands(planes, scales, count, b, g, N, K, w, s, Z);
                for (int64_t rt = 0; rt < tiles; rt++) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    _tile_loadd(4, x + rt * tile * K + g * 32, K * 2);
                    for (int i = 0; i < count; i++) {
                        _tile_loadd(5, &w[16 * i][0], 256);
                        _tile_dpbf16ps(0, 4, 5);
                        _tile_loadd(6, &w[16 * i][1], 256);
                        _tile_dpbf16ps(1, 4, 6);
                        _tile_loadd(5, &w[16 * i][2], 256);
                        _tile_dpbf16ps(2, 4, 5);
                        _tile_loadd(6, &w[16 * i][3], 256);
                        _tile_dpbf16ps(3, 4, 6);
                    }
                    _tile_stored(0, c, 256);
                    _tile_stored(1, c + 16, 256);
                    _tile_stored(2, c + 32, 256);
                    _tile_stored(3, c + 48, 256);
                    for (int64_t r = 0; r < per && rt * per + r < M; r++) {
                        int64_t m = rt * per + r;
                        const float *row = c + r * terms * 64;
                        __m512 P[4];
                        for (int j = 0; j < 4; j++) {
                            P[j] = _mm512_load_ps(row + 16 * j);
                            for (int64_t t = 1; t < terms; t++) /* the terms, in order */
                                P[j] = _mm512_add_ps(P[j], _mm512_load_ps(row + t * 64 + 16 * j));
                        }
                        scale_into(acc + m * 64, P, s, Z, xsum[m * groups + g]);
                    }
                }
            }
            store_rows(acc, M, N, b, y, y_bf16);
        }
        _tile_release();
    }
}
#endif

/* y = x @ W^T for x M rows of K bfloat16, or float32 when x_f32 (then each value becomes
 * three bfloat16 terms, hi + mid + lo, whose sum is the value); y is [M, N] in x's dtype.
 * The terms' rows are copied into a buffer, padded with zero rows to a multiple of
 * 16 / terms * terms, followed by the group sums. AMX tiles where the CPU has them, Linux
 * grants them and allow_amx, else the vector path (other bits, as invariant). Returns 0,
 * or -1 when the buffer cannot be allocated. */
int int4_planes_gemv(const int4_gemv_t *weight, const void *x, int x_f32, int64_t M, void *y,
                     int allow_amx) {
    int64_t N = weight->N, K = weight->K;
    int64_t groups = K / 32, terms = x_f32 ? 3 : 1, tile = 16 / terms * terms;
    if (M <= 0) return 0;
    int64_t padded = (M * terms + tile - 1) / tile * tile;
    size_t bytes = (size_t)(padded * K * 2 + M * groups * 4 + 63) / 64 * 64;
    uint16_t *xp = aligned_alloc(64, bytes);
    if (!xp) return -1;
    float *work = (float *)(xp + padded * K);
    const uint8_t *planes[2] = {weight->p0, weight->p1};
    const uint16_t *scales[2] = {weight->sz0, weight->sz1};
    int count = weight->p1 ? 2 : 1;
    if (x_f32) {
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++) {
                float v = ((const float *)x)[m * K + k];
                uint16_t hi = to_bf16(v), mid = to_bf16(v - from_bf16(hi));
                xp[(m * 3) * K + k] = hi;
                xp[(m * 3 + 1) * K + k] = mid;
                xp[(m * 3 + 2) * K + k] = to_bf16(v - from_bf16(hi) - from_bf16(mid));
            }
    } else {
        memcpy(xp, x, (size_t)(M * K) * 2);
    }
    memset(xp + M * terms * K, 0, (size_t)((padded - M * terms) * K) * 2);
    for (int64_t m = 0; m < M; m++) /* each group's sum of x, in one fixed order */
        for (int64_t g = 0; g < groups; g++) {
            __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
            for (int64_t t = 0; t < terms; t++) {
                const uint16_t *xt = xp + (m * terms + t) * K + g * 32;
                __m512i both = _mm512_loadu_si512(xt);
                s0 = _mm512_add_ps(s0, _mm512_castsi512_ps(_mm512_slli_epi32(both, 16)));
                s1 = _mm512_add_ps(s1, _mm512_castsi512_ps(
                    _mm512_and_si512(both, _mm512_set1_epi32((int)0xFFFF0000u))));
            }
            work[m * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
        }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (allow_amx && amx_allowed())
        gemv_amx(planes, scales, count, N, K, xp, M, terms, work, y, !x_f32);
    else
#endif
        gemv_vector(planes, scales, count, N, K, xp, M, terms, work, y, !x_f32);
    free(xp);
    return 0;
}
#else
int int4_planes_gemv_built(void) { return 0; }
#endif
