/* What the kernel sources share (shardline/models/native_dequant.py compiles every .c
 * file of this folder into one library): bfloat16 conversions and the int4-plane decode
 * product's weight (int4_gemv.c), which the fused decode layers (decode_layer.c) call. */
#ifndef SHARDLINE_KERNELS_H
#define SHARDLINE_KERNELS_H
#include <stdint.h>
#include <string.h>

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
#endif

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

/* y = x @ W^T with x's rows quantized to int8 groups (see int4_gemv.c). */
int int4_planes_gemv(const int4_gemv_t *weight, const void *x, int x_f32, int64_t M, void *y);

#endif
