/* The int4-plane product with int8 activations (see shardline/models/native_dequant.py,
 * Int4Gemv, which loads it, and decode_layer.c, whose fused layers call it). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"

/* The decode product of one or two int4 planes (torch's CPU layout, blocks of 64 rows,
 * "halves" order: byte j of a block's column k holds row j low and row j + 32 high;
 * bfloat16 scales and zeros [K / 32, N, 2], w = (p - 8) * scale + zero; a second plane's
 * scales are 16 times the first's, as shardline/models/int4_planes.py packs 8-bit types)
 * with M rows of activations quantized to int8, for AVX-512 with VNNI and VBMI:
 *
 *   y[m, n] = sum over groups g of  s d P + Z X,
 *   P = sum over the group's k of u[n, k] q[m, k]        in int32, exact,
 *   u = p (one plane) or p + 16 p' (two: one byte), 0 <= u < 256,
 *   q = round(x[m, k] / d) in [-127, 127],  d = max |x[m, k]| / 127 over the group,
 *   X = d times the group's sum of q,  Z = z - 8 s,  or z + z' - 136 s,
 *
 * with s, z the first plane's scale and zero and z' the second's zero, in float32: the
 * product of the rounded activations d q with the weights, up to float32 rounding. The
 * activations' int8 groups are llama.cpp's Q8_1 blocks for its quantized dot products
 * (ggml-quants.c, quantize_row_q8_1); the products are vpdpbusd's (u8 by s8, four at a
 * time into int32).
 * Each weight group is unpacked into 2 KiB of L1 (one byte permutation for 16 rows by 4
 * columns) once per tile of 64 rows (a decode step's are one tile) and multiplied into
 * each of its rows; a row's operations and their order do not depend on M or on the other
 * rows (its integer sums are exact, its float ones in a fixed order), so its result is
 * the same bits in any batch. Threads (OpenMP: torch's own runtime, already loaded) split
 * the (block of 64 outputs, tile) pairs. Where AMX-INT8 is built and granted, a tile of
 * TILE_MIN_ROWS rows or more takes its integer sums from the tiles (group_tiles), the same
 * integers scaled by the same float operations (add_group_row): the same bits. */
#if INT4_GEMV_BUILT
int int4_planes_gemv_built(void) { return 1; }

#define AHEAD 1 /* groups read ahead */

/* Lane i of a quad: bytes i, 32 + i of columns (k, k + 1) and of (k + 2, k + 3) (the
 * permutation that takes two 64-byte loads of a block's plane to 16 rows' quads). */
static inline __m512i quad_spread(void) {
    return _mm512_set_epi8(
        111, 79, 47, 15, 110, 78, 46, 14, 109, 77, 45, 13, 108, 76, 44, 12,
        107, 75, 43, 11, 106, 74, 42, 10, 105, 73, 41, 9, 104, 72, 40, 8,
        103, 71, 39, 7, 102, 70, 38, 6, 101, 69, 37, 5, 100, 68, 36, 4,
        99, 67, 35, 3, 98, 66, 34, 2, 97, 65, 33, 1, 96, 64, 32, 0);
}

/* Group g of block b's s and Z per 16 outputs (see the file's comment). */
static inline __attribute__((always_inline)) void group_scales(
        const uint16_t **scales, int count, int64_t b, int64_t g, int64_t N, __m512 *s, __m512 *Z) {
    for (int r = 0; r < 4; r++) {
        __m512 z, s1, z1;
        scale_zero_16(scales[0] + (g * N + b * 64 + 16 * r) * 2, &s[r], &z);
        if (count == 2) {
            scale_zero_16(scales[1] + (g * N + b * 64 + 16 * r) * 2, &s1, &z1);
            z = _mm512_add_ps(z, z1);
        }
        Z[r] = _mm512_sub_ps(z, _mm512_mul_ps(_mm512_set1_ps(count == 2 ? 136.0f : 8.0f), s[r]));
    }
}

/* Columns 32 g + 4 j .. + 3 of block b as u bytes: w[r] holds rows 16 r .. 16 r + 15 (one
 * per 32-bit lane, a byte a column), from one plane (p) or two (p | p' << 4). */
static inline __attribute__((always_inline)) void quad_operands(
        const uint8_t **planes, int count, int64_t b, int64_t g, int64_t K, int j, __m512i *w) {
    const __m512i spread = quad_spread();
    const __m512i spread16 = _mm512_add_epi8(spread, _mm512_set1_epi8(16));
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512i r0[2], r16[2]; /* low nibbles rows 0-15 (16-31), high rows 32-47 (48-63) */
    for (int i = 0; i < count; i++) {
        const uint8_t *a = planes[i] + (b * K + g * 32 + 4 * j) * 32;
        __m512i ab = _mm512_loadu_si512(a), cd = _mm512_loadu_si512(a + 64);
        r0[i] = _mm512_permutex2var_epi8(ab, spread, cd);
        r16[i] = _mm512_permutex2var_epi8(ab, spread16, cd);
    }
    if (count == 1) {
        w[0] = _mm512_and_si512(r0[0], low);
        w[1] = _mm512_and_si512(r16[0], low);
        w[2] = _mm512_and_si512(_mm512_srli_epi16(r0[0], 4), low);
        w[3] = _mm512_and_si512(_mm512_srli_epi16(r16[0], 4), low);
    } else { /* (low ? first : second) bits: p | p' << 4 */
        w[0] = _mm512_ternarylogic_epi32(low, r0[0], _mm512_slli_epi16(r0[1], 4), 0xCA);
        w[1] = _mm512_ternarylogic_epi32(low, r16[0], _mm512_slli_epi16(r16[1], 4), 0xCA);
        w[2] = _mm512_ternarylogic_epi32(low, _mm512_srli_epi16(r0[0], 4), r0[1], 0xCA);
        w[3] = _mm512_ternarylogic_epi32(low, _mm512_srli_epi16(r16[0], 4), r16[1], 0xCA);
    }
}

/* Group g of block b as u bytes: w[4 j + r] holds rows 16 r .. 16 r + 15 (one per 32-bit
 * lane) by columns 32 g + 4 j .. + 3 (one per byte), and per 16 outputs s and Z. */
static inline void group_operands(const uint8_t **planes, const uint16_t **scales, int count,
                                  int64_t b, int64_t g, int64_t N, int64_t K,
                                  __m512i *w, __m512 *s, __m512 *Z) {
    for (int i = 0; i < count; i++)
        if (g + AHEAD < K / 32) { /* the next group (its scales are N * 4 bytes on) */
            const char *later = (const char *)(planes[i] + (b * K + (g + AHEAD) * 32) * 32);
            for (int line = 0; line < 16; line++) _mm_prefetch(later + 64 * line, _MM_HINT_T0);
            later = (const char *)(scales[i] + ((g + AHEAD) * N + b * 64) * 2);
            for (int line = 0; line < 4; line++) _mm_prefetch(later + 64 * line, _MM_HINT_T0);
        }
    for (int j = 0; j < 8; j++) quad_operands(planes, count, b, g, K, j, w + 4 * j);
    group_scales(scales, count, b, g, N, s, Z);
}

/* Adds group g's sums of one row into its 64 accumulators am: part[i] holds the row's
 * integer products P of outputs 16 i .. 16 i + 15, dv and xv its d and X broadcast. The one
 * place these float operations are written: the VNNI and the tile products both call it,
 * so their results are the same bits. */
static inline __attribute__((always_inline)) void add_group_row(
        float *am, const __m512 *s, const __m512 *Z, __m512 dv, __m512 xv, const __m512i *part) {
    for (int i = 0; i < 4; i++) {
        __m512 a = _mm512_fmadd_ps(_mm512_mul_ps(s[i], dv), _mm512_cvtepi32_ps(part[i]),
                                   _mm512_load_ps(am + 16 * i));
        _mm512_store_ps(am + 16 * i, _mm512_fmadd_ps(Z[i], xv, a));
    }
}

/* Group g's products for rows [m, m + rows) (rows 1 or 2, a constant after inlining),
 * added into acc (64 float32 a row, from row m's): each row's sums take the same
 * operations in the same order either way. q: int8 [M, K]; d, xsum: float32 [M, K / 32]. */
static inline __attribute__((always_inline)) void group_rows(
        const __m512i *w, const __m512 *s, const __m512 *Z, const int8_t *q, const float *d,
        const float *xsum, float *acc, int64_t m, int rows, int64_t K, int64_t g) {
    __m512i part[2][4];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) part[r][j] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        __m512i xq[2];
#pragma GCC unroll 2
        for (int r = 0; r < rows; r++) {
            int32_t four;
            memcpy(&four, q + (m + r) * K + g * 32 + 4 * j, 4);
            xq[r] = _mm512_set1_epi32(four);
        }
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
#pragma GCC unroll 2
            for (int r = 0; r < rows; r++)
                part[r][i] = _mm512_dpbusd_epi32(part[r][i], w[4 * j + i], xq[r]);
    }
    for (int r = 0; r < rows; r++)
        add_group_row(acc + r * 64, s, Z, _mm512_set1_ps(d[(m + r) * (K / 32) + g]),
                      _mm512_set1_ps(xsum[(m + r) * (K / 32) + g]), part[r]);
}

/* Group g's products for rows [m, m + rows) (rows 1 to FEW_ROWS, a constant after
 * inlining), the weights unpacked straight into the dot products (group_operands' bytes,
 * never stored: a step of a few rows would read each back a few times, and the 2 KiB of
 * w spilled and reloaded cost more than the products), then add_group_row for each row
 * as group_rows does: the same integers, the same float operations. acc: 64 float32 a
 * row, from row m's. */
#define FEW_ROWS 4
static inline __attribute__((always_inline)) void group_few_rows(
        const uint8_t **planes, const uint16_t **scales, int count, int64_t b, int64_t g,
        int64_t N, int64_t K, const int8_t *q, const float *d, const float *xsum, float *acc,
        int64_t m, const int rows) {
    __m512i part[FEW_ROWS][4];
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < 4; i++) part[r][i] = _mm512_setzero_si512();
    /* Two planes: ask for the next group's scales (N * 4 bytes on in each plane's, a
     * stride the hardware did not follow): one Zen 4 thread streamed a Q8_0 LM head at
     * 27 GB/s where it streamed 20. One plane streams as fast without (and 7-20% slower
     * with: the lines are already on their way). */
    if (count == 2 && g + 1 < K / 32)
        for (int i = 0; i < 2; i++)
            for (int line = 0; line < 4; line++)
                _mm_prefetch((const char *)(scales[i] + ((g + 1) * N + b * 64) * 2) + 64 * line,
                             _MM_HINT_T0);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        __m512i w[4];
        quad_operands(planes, count, b, g, K, j, w);
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++) {
            int32_t four;
            memcpy(&four, q + (m + r) * K + g * 32 + 4 * j, 4);
            __m512i xq = _mm512_set1_epi32(four);
            for (int i = 0; i < 4; i++) part[r][i] = _mm512_dpbusd_epi32(part[r][i], w[i], xq);
        }
    }
    __m512 s[4], Z[4];
    group_scales(scales, count, b, g, N, s, Z);
    for (int r = 0; r < rows; r++)
        add_group_row(acc + r * 64, s, Z, _mm512_set1_ps(d[(m + r) * (K / 32) + g]),
                      _mm512_set1_ps(xsum[(m + r) * (K / 32) + g]), part[r]);
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define INT4_AMX_INT8 1
/* The tile product's configuration. Tile 0: 16 rows of q by a group's 32 columns; 1-4:
 * the group's weights as tdpbsud's B operand, 8 quads of columns by 16 outputs (16 r ..
 * 16 r + 15 in tile 1 + r, one 32-bit lane each: group_operands' w[4 j + r] is row j);
 * 5-6: the int32 sums of 16 rows by 16 outputs. */
static void configure_int8_tiles(void) {
    tile_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = 16, c.colsb[0] = 32;
    for (int t = 1; t <= 4; t++) c.rows[t] = 8, c.colsb[t] = 64;
    for (int t = 5; t <= 6; t++) c.rows[t] = 16, c.colsb[t] = 64;
    __asm__ __volatile__("" ::: "memory"); /* gcc 12 drops the stores above otherwise */
    _tile_loadconfig(&c);
}

/* Group g's products for rows [m0, end) on the tiles (tdpbsud: s8 activations by u8
 * weights into int32, Intel's Architecture Instruction Set Extensions Programming
 * Reference, chapter 3), 16 rows at a time, then each row's float sums by add_group_row:
 * the same integers and the same float operations as group_rows. q holds whole tiles of
 * 16 rows (zeros past M); wb: 2 KiB scratch, P: 4 KiB. */
static void group_tiles(const __m512i *w, const __m512 *s, const __m512 *Z, const int8_t *q,
                        const float *d, const float *xsum, float *acc, int64_t m0, int64_t end,
                        int64_t K, int64_t g, uint8_t *wb, int32_t *P) {
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 8; j++) _mm512_store_si512(wb + (r * 8 + j) * 64, w[4 * j + r]);
    _tile_loadd(1, wb, 64); /* (tile numbers are immediates) */
    _tile_loadd(2, wb + 512, 64);
    _tile_loadd(3, wb + 1024, 64);
    _tile_loadd(4, wb + 1536, 64);
    for (int64_t m = m0; m < end; m += 16) {
        _tile_loadd(0, q + m * K + g * 32, K);
        _tile_zero(5);
        _tile_zero(6);
        _tile_dpbsud(5, 0, 1);
        _tile_dpbsud(6, 0, 2);
        _tile_stored(5, P, 256);
        _tile_stored(6, P + 16, 256);
        _tile_zero(5);
        _tile_zero(6);
        _tile_dpbsud(5, 0, 3);
        _tile_dpbsud(6, 0, 4);
        _tile_stored(5, P + 32, 256);
        _tile_stored(6, P + 48, 256);
        for (int64_t i = 0; i < 16 && m + i < end; i++) {
            __m512i part[4];
            for (int j = 0; j < 4; j++) part[j] = _mm512_load_si512(P + 64 * i + 16 * j);
            add_group_row(acc + (m + i - m0) * 64, s, Z, _mm512_set1_ps(d[(m + i) * (K / 32) + g]),
                          _mm512_set1_ps(xsum[(m + i) * (K / 32) + g]), part);
        }
    }
}
#else
#define INT4_AMX_INT8 0
#endif

/* Rows of a tile from which the tile product runs (where the tiles may be used); fewer
 * take vpdpbusd, two rows at a time. Either gives the same bits. On a 2-vCPU Sapphire
 * Rapids VM (a 17,920 x 1,536 weight, 2 threads, interleaved runs) the tiles took 10-20%
 * less time from 16 to 128 rows, and at 8 rows (half of every tile of q zeros) no less. */
#define TILE_MIN_ROWS 16

/* y = x @ W^T for x M rows of K bfloat16, or float32 when x_f32; y is [M, N] in x's
 * dtype. Threads take (block of 64 outputs, tile of 64 rows) pairs: a tile unpacks the
 * block's groups again (a prefill chunk's rows), a row's operations stay its own.
 * Returns 0, or -1 when the activations' int8 copy cannot be allocated. */
int int4_planes_gemv(const int4_gemv_t *weight, const void *x, int x_f32, int64_t M, void *y) {
    int64_t N = weight->N, K = weight->K, groups = K / 32;
    if (M <= 0) return 0;
    int64_t padded = (M + 15) / 16 * 16; /* whole tiles of q rows for the tile product */
    size_t bytes = (size_t)(padded * K + 2 * M * groups * 4 + 63) / 64 * 64;
    int8_t *q = aligned_alloc(64, bytes);
    if (!q) return -1;
    float *d = (float *)(q + padded * K), *xsum = d + M * groups;
    for (int64_t m = 0; m < M; m++)
        quantize_row((const char *)x + m * K * (x_f32 ? 4 : 2), x_f32, K, 32, q + m * K,
                     d + m * groups, xsum + m * groups);
    memset(q + M * K, 0, (size_t)((padded - M) * K));
    const uint8_t *planes[2] = {weight->p0, weight->p1};
    const uint16_t *scales[2] = {weight->sz0, weight->sz1};
    int count = weight->p1 ? 2 : 1;
    int64_t tiles = (M + 63) / 64;
    int amx = INT4_AMX_INT8 && M >= TILE_MIN_ROWS && amx_tiles_ready();
#pragma omp parallel if (!in_parallel())
    {
#if INT4_AMX_INT8
        uint8_t wb[2048] __attribute__((aligned(64)));
        int32_t P[16 * 64] __attribute__((aligned(64)));
        if (amx) configure_int8_tiles();
#endif
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < N / 64; b++) {
        for (int64_t t = 0; t < tiles; t++) {
            float acc[64 * 64] __attribute__((aligned(64)));
            __m512i w[32];
            int64_t m0 = t * 64, end = m0 + 64 < M ? m0 + 64 : M;
            for (int64_t i = 0; i < (end - m0) * 64; i++) acc[i] = 0.0f;
            if (end - m0 <= FEW_ROWS) { /* a few rows: unpacked into the products, nothing stored */
                int64_t n = end - m0;
                for (int64_t g = 0; g < groups; g++) {
                    if (n == 1) group_few_rows(planes, scales, count, b, g, N, K, q, d, xsum, acc, m0, 1);
                    else if (n == 2) group_few_rows(planes, scales, count, b, g, N, K, q, d, xsum, acc, m0, 2);
                    else if (n == 3) group_few_rows(planes, scales, count, b, g, N, K, q, d, xsum, acc, m0, 3);
                    else group_few_rows(planes, scales, count, b, g, N, K, q, d, xsum, acc, m0, 4);
                }
                goto stored;
            }
            for (int64_t g = 0; g < groups; g++) {
                __m512 s[4], Z[4];
                group_operands(planes, scales, count, b, g, N, K, w, s, Z);
                int64_t m = m0;
#if INT4_AMX_INT8
                if (amx && end - m0 >= TILE_MIN_ROWS) {
                    group_tiles(w, s, Z, q, d, xsum, acc, m0, end, K, g, wb, P);
                    continue;
                }
#endif
                for (; m + 2 <= end; m += 2) /* two rows at a time: more independent sums */
                    group_rows(w, s, Z, q, d, xsum, acc + (m - m0) * 64, m, 2, K, g);
                if (m < end)
                    group_rows(w, s, Z, q, d, xsum, acc + (m - m0) * 64, m, 1, K, g);
            }
        stored:
            for (int64_t m = m0; m < end; m++) {
                const float *row = acc + (m - m0) * 64;
                if (x_f32) {
                    memcpy((float *)y + m * N + b * 64, row, 64 * sizeof(float));
                } else {
                    uint16_t *out = (uint16_t *)y + m * N + b * 64;
                    for (int j = 0; j < 4; j++)
                        _mm256_storeu_si256((__m256i *)(out + 16 * j), bf16_16(_mm512_load_ps(row + 16 * j)));
                }
            }
        }
    }
#if INT4_AMX_INT8
        if (amx) _tile_release();
#endif
    }
    free(q);
    return 0;
}
#else /* not built: native_dequant.py calls the product only where int4_planes_gemv_built() */
int int4_planes_gemv_built(void) { return 0; }
int int4_planes_gemv(const int4_gemv_t *weight, const void *x, int x_f32, int64_t M, void *y) {
    (void)weight, (void)x, (void)x_f32, (void)M, (void)y;
    return -1;
}
#endif
