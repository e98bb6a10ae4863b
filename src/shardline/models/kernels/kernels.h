/* What the kernel sources share (shardline/models/native_dequant.py compiles every .c
 * file of this folder into one library): bfloat16 conversions and the decode products'
 * weights (int4 planes, int4_gemv.c; packed 5/6-bit groups, packed_groups.c), which the fused
 * decode layers (decode_layer.c) call. */
#ifndef SHARDLINE_KERNELS_H
#define SHARDLINE_KERNELS_H
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* Whether the caller already runs on a team's thread (the fused decode layers' experts,
 * each on one thread): a product's own region then stays on the calling thread. */
static inline int in_parallel(void) {
#ifdef _OPENMP
    return omp_in_parallel();
#else
    return 0;
#endif
}

/* bfloat16 rounding is round-to-nearest-even on the float32 bits (values are finite). */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

/* from_bf16 of 16 bfloat16 values at p. */
static inline __m512 from_bf16_16(const void *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* to_bf16 of 16 float32 lanes. */
static inline __m256i bf16_16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

/* 16 (scale, zero) bfloat16 pairs at sz as float32 scales s and zeros z. */
static inline void scale_zero_16(const uint16_t *sz, __m512 *s, __m512 *z) {
    __m512i both = _mm512_loadu_si512(sz);
    *s = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
    *z = _mm512_castsi512_ps(_mm512_and_si512(both, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* An int4 plane's scales s and centred zeros z - 8 s of 16 rows (w = p s + (z - 8 s)), from
 * its (scale, zero) bfloat16 pairs at sz. */
static inline void plane_scale_zero_16(const uint16_t *sz, __m512 *s, __m512 *z) {
    scale_zero_16(sz, s, z);
    *z = _mm512_sub_ps(*z, _mm512_mul_ps(_mm512_set1_ps(8.0f), *s));
}

/* Column k of a block of 64 rows of one or two int4 planes in torch's "halves" layout
 * (col0, col1: the column's 32 bytes in each plane, byte j holding row j low and row j + 32
 * high; col1 NULL for one plane) as float32: t[r] holds rows 16 r .. 16 r + 15, each plane's
 * p s + z (plane_scale_zero_16's s[i][r], z[i][r]) summed in plane order, without fused
 * multiply-adds: the eager code's values, bit for bit. */
static inline void block_column_64(const uint8_t *col0, const uint8_t *col1, __m512 s[2][4],
                                   __m512 z[2][4], __m512 t[4]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const uint8_t *cols[2] = {col0, col1};
    for (int i = 0; i < (col1 ? 2 : 1); i++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)cols[i]);
        __m256i lo = _mm256_and_si256(v, low);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        __m128i part[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                           _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
        for (int r = 0; r < 4; r++) {
            __m512 w = _mm512_add_ps(
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(part[r])), s[i][r]), z[i][r]);
            t[r] = i ? _mm512_add_ps(t[r], w) : w;
        }
    }
}
#endif

#if defined(__AMX_TILE__)
/* An AMX tile configuration (palette 1: up to 8 tiles of up to 16 rows of 64 bytes), as
 * ldtilecfg reads it (Intel's Architecture Instruction Set Extensions Programming
 * Reference, chapter 3). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;
#endif

/* Whether this process may use AMX tiles (amx_prefill.c; 0 where they are not built). */
int amx_tiles_ready(void);

/* A weight for int4_planes_gemv: the planes' bytes and scales (p1, sz1 NULL for one). */
typedef struct {
    const uint8_t *p0;
    const uint16_t *sz0;
    const uint8_t *p1;
    const uint16_t *sz1;
    int64_t N, K;
} int4_gemv_t;

/* Whether int4_planes_gemv is built: it needs AVX-512 VNNI and VBMI (with BW, which
 * VBMI implies, for the AVX-512 helpers). */
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define INT4_GEMV_BUILT 1
#else
#define INT4_GEMV_BUILT 0
#endif

#if INT4_GEMV_BUILT /* (implies AVX-512 F and BW: immintrin.h is included above) */
/* Row x (K bfloat16, or float32 when x_f32) as int8 groups of 32: q = round(x / d)
 * (ties to even) with d = max |x| / 127 per group (llama.cpp's Q8_1 blocks,
 * ggml-quants.c's quantize_row_q8_1), and xsum = d times the sum of q per group of
 * `group` (32, or 16: each half of a group of 32). */
static inline void quantize_row(const void *x, int x_f32, int64_t K, int64_t group, int8_t *q,
                                float *d, float *xsum) {
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (int64_t g = 0; g < K / 32; g++) {
        __m512 v[2];
        for (int h = 0; h < 2; h++) {
            int64_t k = g * 32 + 16 * h;
            v[h] = x_f32 ? _mm512_loadu_ps((const float *)x + k)
                         : from_bf16_16((const uint16_t *)x + k);
        }
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v[0], magnitude),
                                                         _mm512_and_ps(v[1], magnitude)));
        __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v[0], inv)); /* nearest, ties to even */
        __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v[1], inv));
        _mm_storeu_si128((__m128i *)(q + g * 32), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(q + g * 32 + 16), _mm512_cvtsepi32_epi8(q1));
        d[g] = amax / 127.0f;
        if (group == 32) {
            xsum[g] = d[g] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        } else {
            xsum[2 * g] = d[g] * (float)_mm512_reduce_add_epi32(q0);
            xsum[2 * g + 1] = d[g] * (float)_mm512_reduce_add_epi32(q1);
        }
    }
}
#endif

/* y = x @ W^T with x's rows quantized to int8 groups (see int4_gemv.c). */
int int4_planes_gemv(const int4_gemv_t *weight, const void *x, int x_f32, int64_t M, void *y);

/* A weight of packed 5- or 6-bit groups (packed_groups.c describes the layout;
 * shardline/models/packed_groups.py holds it): rows x K, one scale (and offset, or NULL)
 * per group of 16 or 32, bfloat16 when scales_bf16 else float32, hb = bits - 4; or of
 * 4-bit codes (hb 0), the integer of code c codebook[c]. */
typedef struct {
    const uint8_t *low, *high;
    const void *scale, *offset;
    int32_t center, hb, scales_bf16;
    int64_t group, rows, K;
    const uint8_t *codebook; /* [16] or NULL */
} packed_groups_t;

/* y = x @ W^T in float32 for x [M, K] (bfloat16, or float32 when x_f32) rounded to int8
 * groups, y [M, rows] (see packed_groups.c). */
int packed_groups_q8_gemv(const packed_groups_t *w, const void *x, int x_f32, int64_t M,
                          float *y);

/* Rows ids[0 .. n) of w into out, float32 (or bfloat16 when out_bf16, through work
 * float32 [K]) (see packed_groups.c). */
void packed_groups_rows(const packed_groups_t *pw, const int64_t *ids, int64_t n, void *out,
                        int out_bf16, float *work);

/* A dense bfloat16 weight [N, K], row-major (dense_gemv.c). */
typedef struct {
    const uint16_t *w;
    int64_t N, K;
} dense_t;

/* Whether dense_bf16_gemv is built: it needs AVX-512 BF16. */
int dense_gemv_built(void);

/* y [M, N] float32 = x [M, K] bfloat16 @ W^T, each output by the same instructions
 * whatever the batch (see dense_gemv.c). Returns 0 (-1 where it is not built). */
int dense_bf16_gemv(const dense_t *w, const uint16_t *x, int64_t M, float *y);

#endif
