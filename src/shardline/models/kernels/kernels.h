/* What the kernel sources share (shardline/models/native_dequant.py compiles every .c
 * file of this folder into one library): bfloat16 conversions and the int4-plane decode
 * product's weight (dequant.c), which the fused decode layers (decode_layer.c) call. */
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

/* A weight for int4_planes_gemv: the planes' bytes and scales (p1, sz1 NULL for one). */
typedef struct {
    const uint8_t *p0;
    const uint16_t *sz0;
    const uint8_t *p1;
    const uint16_t *sz1;
    int64_t N, K;
} int4_gemv_t;

/* Whether int4_planes_gemv is built: it needs AVX-512 VNNI and VBMI (with BW, which
 * VBMI implies, for dequant.c's AVX-512 helpers). */
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define INT4_GEMV_BUILT 1
#else
#define INT4_GEMV_BUILT 0
#endif

/* y = x @ W^T with x's rows quantized to int8 groups (see dequant.c). */
int int4_planes_gemv(const int4_gemv_t *weight, const void *x, int x_f32, int64_t M, void *y);

#endif
