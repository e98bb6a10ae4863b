/* Decode products of a dense bfloat16 weight (a safetensors model's, an F16/BF16 GGUF's
 * held in bfloat16; shardline/models/linear.py's DenseWeight): y [M, N] float32 =
 * x [M, K] bfloat16 @ W^T for W [N, K] bfloat16, row-major.
 *
 * Each output y[m][n] is a dot product of W's row n and x's row m by AVX-512 BF16's
 * vdpbf16ps (32 bfloat16 pairs an instruction, each pair of products added into one of 16
 * float32 lanes), 32 columns at a time in order (the last 16, where K is not a multiple
 * of 32, with the other half zero), and the 16 lanes summed by one fixed reduction: the
 * same instructions in the same order whatever M, the other rows and outputs, or the
 * threads, so a decoding sequence's output does not depend on its batch or its draft's
 * rows. A block of BLOCK weight rows is read from memory once for all M rows, each of its
 * vectors loaded once for ROWS rows of x. Threads (OpenMP, torch's count) split the
 * blocks. */
#include <stdint.h>
#include "kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

int dense_gemv_built(void) { return 1; }

#define BLOCK 4 /* weight rows a task */
#define ROWS 4  /* rows of x a pass over a block's weight */

/* y[m][n0 .. n0 + nb) for every row m (nb <= BLOCK): ROWS rows of x at a time, each
 * weight vector loaded once for them. */
static void dense_block(const dense_t *w, const uint16_t *x, int64_t M, int64_t n0, int64_t nb,
                        float *y) {
    const int64_t K = w->K, whole = K / 32 * 32;
    const __mmask32 tail = (__mmask32)((1ull << (K - whole)) - 1);
    const uint16_t *wr = w->w + n0 * K;
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
        const int64_t mb = M - m0 < ROWS ? M - m0 : ROWS;
        const uint16_t *xr = x + m0 * K;
        __m512 acc[ROWS][BLOCK];
        for (int64_t i = 0; i < mb; i++)
            for (int64_t j = 0; j < nb; j++) acc[i][j] = _mm512_setzero_ps();
        for (int64_t k = 0; k < whole; k += 32) {
            __m512bh xv[ROWS];
            for (int64_t i = 0; i < mb; i++) xv[i] = (__m512bh)_mm512_loadu_si512(xr + i * K + k);
            for (int64_t j = 0; j < nb; j++) {
                __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + j * K + k);
                for (int64_t i = 0; i < mb; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[i]);
            }
        }
        if (tail) {
            __m512bh xv[ROWS];
            for (int64_t i = 0; i < mb; i++)
                xv[i] = (__m512bh)_mm512_maskz_loadu_epi16(tail, xr + i * K + whole);
            for (int64_t j = 0; j < nb; j++) {
                __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + j * K + whole);
                for (int64_t i = 0; i < mb; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[i]);
            }
        }
        for (int64_t i = 0; i < mb; i++)
            for (int64_t j = 0; j < nb; j++) y[(m0 + i) * w->N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]);
    }
}

int dense_bf16_gemv(const dense_t *w, const uint16_t *x, int64_t M, float *y) {
    const int64_t blocks = (w->N + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) if (!in_parallel() && w->N * w->K >= 65536)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = b * BLOCK, nb = w->N - n0 < BLOCK ? w->N - n0 : BLOCK;
        dense_block(w, x, M, n0, nb, y);
    }
    return 0;
}
#else
int dense_gemv_built(void) { return 0; }
int dense_bf16_gemv(const dense_t *w, const uint16_t *x, int64_t M, float *y) {
    (void)w, (void)x, (void)M, (void)y;
    return -1;
}
#endif
