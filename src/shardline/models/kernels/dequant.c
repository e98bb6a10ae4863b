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
 * symmetric types, e.g. Q6_K's d * sc * (q - 32)). */
typedef struct {
    const uint8_t *low, *high;    /* the row's dword 0 of chunk 0 */
    const uint8_t *scale, *offset; /* the row's group 0 */
    int center, hb, scales_bf16;
    int64_t group, K;
} packed_row_t;

/* Group g's scale (or offset) of a row whose group 0 is at p. */
static inline float scalar_at(const uint8_t *p, int64_t g, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)p)[16 * g]) : ((const float *)p)[16 * g];
}

static inline packed_row_t packed_at(const packed_groups_t *w, int64_t r) {
    int64_t chunks = w->K / 32, groups = w->K / w->group, size = w->scales_bf16 ? 2 : 4;
    int64_t block = r / 16, lane = r % 16;
    packed_row_t row = {w->low + block * chunks * 256 + lane * 4,
                        w->high + block * chunks * 64 * w->hb + lane * 4,
                        (const uint8_t *)w->scale + (block * groups * 16 + lane) * size,
                        w->offset ? (const uint8_t *)w->offset + (block * groups * 16 + lane) * size
                                  : NULL,
                        w->center, w->hb, w->scales_bf16, w->group, w->K};
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
    if (w->hb == 2) {
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
    const uint8_t *l = w->low + c * 256, *hp = w->high + c * 64 * w->hb;
    __m128i lb = _mm_setr_epi32(dword_at(l), dword_at(l + 64), dword_at(l + 128), dword_at(l + 192));
    __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(lb, 4), m4), _mm_and_si128(lb, m4));
    __m256i hi;
    if (w->hb == 2) {
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

/* y[m * rows + r] = sum over k of W[r, k] * x[m, k] for x float32 [M, K] (the weight's
 * rows and K in w). Each group's sum of x (read only with offsets) is summed here, in
 * order. Threads (OpenMP) split the rows, each with its own buffer of SEGMENT + 16 M
 * float32; a row's operations do not depend on the split. Returns 0, or -1 when a buffer
 * cannot be allocated. */
#define SEGMENT 1024 /* weights unpacked at a time for several sequences: a multiple of 32 */
int packed_groups_gemv(const packed_groups_t *pw, const float *restrict x, int64_t M,
                       float *restrict y) {
    const void *offset = pw->offset;
    int center = pw->center, scales_bf16 = pw->scales_bf16;
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
#pragma omp parallel reduction(| : failed)
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
                        part += (float)(w.offset ? q[k - c * 32] : q[k - c * 32] - center) * xm[k];
                    acc += scalar_at(w.scale, g, scales_bf16) * part;
                    if (w.offset) o += scalar_at(w.offset, g, scales_bf16) * xsum[m * groups + g];
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
