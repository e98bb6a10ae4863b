/* The prefill product of int4 planes on AMX tiles (see shardline/models/native_dequant.py,
 * Int4Gemv.prefill, which calls it): y = x @ W^T for a chunk of bfloat16 rows, W the sum of
 * one or two int4 planes (the layout int4_gemv.c reads).
 *
 * Each thread takes blocks of 64 outputs. It dequantizes a block once, for every row of
 * the chunk, into bfloat16 in L2 (each value as the eager code and dequant.c compute it:
 * p * s + (z - 8 s) per plane in float32 without fused multiply-adds, summed, rounded to
 * bfloat16 once), laid out as tdpbf16ps's B operand (pairs of inputs by 16 outputs), then
 * multiplies 32 rows by 32 outputs at a time on the tiles with float32 sums (Intel's
 * Architecture Instruction Set Extensions Programming Reference, chapter 3: AMX), and
 * rounds the sums to bfloat16. The values are those of the dequantized-weight GEMM up to
 * the order of float32 sums; no weight is written to memory beyond the thread's block
 * (the GEMM path writes and reads the whole dequantized weight every chunk). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Whether this process may use the tiles: Linux grants their state on request (once per
 * process; asking again is harmless). int4_gemv.c's int8 tile product asks here too. */
int amx_tiles_ready(void) {
    static int state; /* 0 not asked, 1 granted, -1 refused */
    if (!state) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) ? -1 : 1;
    return state > 0;
}

/* Tiles 0-1: 16 rows of x by 32 inputs; 2-3: 16 input pairs by 16 outputs; 4-7: sums of
 * 16 rows by 16 outputs. All 16 rows of 64 bytes. */
static void configure(void) {
    tile_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    __asm__ __volatile__("" ::: "memory"); /* gcc 12 drops the stores above otherwise */
    _tile_loadconfig(&c);
}

/* Block b (outputs 64 b .. 64 b + 63) of W as B tiles: wb[(k / 2) * 128 + n * 2 + k % 2] =
 * W[64 b + n, k] in bfloat16. */
static void dequantize_block(const int4_gemv_t *w, int64_t b, uint16_t *wb) {
    const uint16_t *scales[2] = {w->sz0, w->sz1};
    int count = w->p1 ? 2 : 1;
    int64_t N = w->N, K = w->K;
    for (int64_t g = 0; g < K / 32; g++) {
        __m512 s[2][4], z[2][4];
        for (int i = 0; i < count; i++)
            for (int r = 0; r < 4; r++)
                plane_scale_zero_16(scales[i] + (g * N + b * 64 + 16 * r) * 2, &s[i][r], &z[i][r]);
        for (int64_t k = g * 32; k < g * 32 + 32; k += 2) {
            __m256i pair[2][4]; /* columns k, k + 1; outputs 16 r .. 16 r + 15 */
            for (int c = 0; c < 2; c++) {
                __m512 t[4];
                int64_t at = (b * K + k + c) * 32;
                block_column_64(w->p0 + at, w->p1 ? w->p1 + at : NULL, s, z, t);
                for (int r = 0; r < 4; r++) pair[c][r] = bf16_16(t[r]);
            }
            uint16_t *row = wb + (k / 2) * 128;
            for (int r = 0; r < 4; r++) {
                __m256i lo = _mm256_unpacklo_epi16(pair[0][r], pair[1][r]);
                __m256i hi = _mm256_unpackhi_epi16(pair[0][r], pair[1][r]);
                _mm256_store_si256((__m256i *)(row + 32 * r), _mm256_permute2x128_si256(lo, hi, 0x20));
                _mm256_store_si256((__m256i *)(row + 32 * r + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
            }
        }
    }
}

/* y [M, N] bfloat16 = x [M, K] bfloat16 @ W^T. Returns 0; -1 without memory for the
 * scratch; -2 where the tiles may not be used (amx_tiles_ready). */
int int4_planes_amx_prefill(const int4_gemv_t *w, const uint16_t *x, int64_t M, uint16_t *y) {
    int64_t N = w->N, K = w->K, rows = (M + 31) / 32 * 32;
    if (M <= 0) return 0;
    if (!amx_tiles_ready()) return -2;
    uint16_t *xp = aligned_alloc(64, (size_t)(rows * K * 2 + 63) / 64 * 64);
    if (!xp) return -1;
    memcpy(xp, x, (size_t)(M * K * 2));
    memset(xp + M * K, 0, (size_t)((rows - M) * K * 2));
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *wb = aligned_alloc(64, (size_t)K * 128);
        float *sums = aligned_alloc(64, 32 * 32 * sizeof(float));
        int ready = wb && sums;
        if (ready) configure();
        else failed = 1;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < N / 64; b++) {
            if (!ready) continue;
            dequantize_block(w, b, wb);
            for (int64_t m = 0; m < M; m += 32) {
                for (int h = 0; h < 2; h++) { /* outputs 32 h .. 32 h + 31 of the block */
                    _tile_zero(4);
                    _tile_zero(5);
                    _tile_zero(6);
                    _tile_zero(7);
                    for (int64_t k = 0; k < K; k += 32) {
                        _tile_loadd(0, xp + m * K + k, K * 2);
                        _tile_loadd(1, xp + (m + 16) * K + k, K * 2);
                        _tile_loadd(2, wb + (k / 2) * 128 + 32 * (2 * h), 256);
                        _tile_loadd(3, wb + (k / 2) * 128 + 32 * (2 * h + 1), 256);
                        _tile_dpbf16ps(4, 0, 2);
                        _tile_dpbf16ps(5, 0, 3);
                        _tile_dpbf16ps(6, 1, 2);
                        _tile_dpbf16ps(7, 1, 3);
                    }
                    _tile_stored(4, sums, 128);
                    _tile_stored(5, sums + 16, 128);
                    _tile_stored(6, sums + 16 * 32, 128);
                    _tile_stored(7, sums + 16 * 32 + 16, 128);
                    for (int64_t i = 0; i < 32 && m + i < M; i++) {
                        uint16_t *out = y + (m + i) * N + b * 64 + 32 * h;
                        _mm256_storeu_si256((__m256i *)out, bf16_16(_mm512_load_ps(sums + 32 * i)));
                        _mm256_storeu_si256((__m256i *)(out + 16),
                                            bf16_16(_mm512_load_ps(sums + 32 * i + 16)));
                    }
                }
            }
        }
        if (ready) _tile_release();
        free(wb);
        free(sums);
    }
    free(xp);
    return failed ? -1 : 0;
}
#else
int amx_tiles_ready(void) { return 0; }
int int4_planes_amx_prefill(const int4_gemv_t *w, const uint16_t *x, int64_t M, uint16_t *y) {
    (void)w, (void)x, (void)M, (void)y;
    return -2;
}
#endif
