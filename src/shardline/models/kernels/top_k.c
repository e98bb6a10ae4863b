/* The k largest entries of each row of an LM head's logits, and their float32
 * recomputation for packed 5/6-bit weights (shardline/models/linear.py, Linear._refined):
 * one compiled call where torch took seven small ops and a row's k weight rows each
 * dequantized through the tensor API (0.3 ms of a 10 ms decode step of a 49,152-row head). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "kernels.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Entry j of row joins best (k ids, their values in val) if above the smallest held,
 * val[low], taking its place; returns the index of the smallest held then. */
static inline int64_t take(const float *row, int64_t j, int64_t k, int64_t *best, float *val,
                           int64_t low) {
    if (!(row[j] > val[low])) return low;
    best[low] = j, val[low] = row[j];
    for (int64_t i = 0; i < k; i++)
        if (val[i] < val[low]) low = i;
    return low;
}

/* ids[m k .. m k + k) = the indices of the k largest entries of row m of y (float32
 * [rows, n], n >= k), in no set order; where several entries tie with the k-th largest,
 * which of them is free. One pass a row keeping the k best so far; where AVX-512 is
 * built, 16 entries at a time are compared with the bar and only those above it looked
 * at (a row of random logits replaces its best ~k ln(n / k) times). A row's ids depend on
 * that row alone. NaN entries count as the smallest (where torch.topk takes them as the
 * largest: a row with NaN logits is a broken model's). Returns -1 when k > 64. */
int top_k_rows(const float *y, int64_t rows, int64_t n, int64_t k, int64_t *ids) {
    if (k > 64 || k > n) return -1;
    for (int64_t m = 0; m < rows; m++) {
        const float *row = y + m * n;
        int64_t *best = ids + m * k;
        float val[64];
        int64_t low = 0; /* the smallest held: the bar a later entry must pass */
        for (int64_t i = 0; i < k; i++) { /* a NaN among them held as -inf: the bar stays a number */
            best[i] = i, val[i] = row[i] == row[i] ? row[i] : -INFINITY;
            if (val[i] < val[low]) low = i;
        }
        int64_t j = k;
#if defined(__AVX512F__)
        for (; j + 16 <= n; j += 16) {
            __mmask16 over = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), _mm512_set1_ps(val[low]),
                                                _CMP_GT_OQ);
            while (over) {
                int t = __builtin_ctz(over);
                over &= over - 1;
                low = take(row, j + t, k, best, val, low);
            }
        }
#endif
        for (; j < n; j++) low = take(row, j, k, best, val, low);
    }
    return 0;
}

/* y[m, ids[m k + i]] = the float32 product of row ids[m k + i] of w with row m of x
 * (float32 [M, K]), for the ids top_k_rows gives: the weight's values as
 * packed_groups_rows computes them, each product summed in 16 lanes in order of k, then
 * the lanes in order (the same operations for a row whatever the other rows). work:
 * float32 [K]. Returns -1 as top_k_rows does. */
int packed_groups_refine(const packed_groups_t *w, const float *x, int64_t M, float *y,
                         int64_t k, int64_t *ids, float *work) {
    int64_t K = w->K, n = w->rows;
    if (top_k_rows(y, M, n, k, ids)) return -1;
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
        for (int64_t i = 0; i < k; i++) {
            int64_t id = ids[m * k + i];
            packed_groups_rows(w, &id, 1, work, 0, NULL);
            float lane[16] = {0};
            for (int64_t c = 0; c < K; c += 16)
                for (int l = 0; l < 16; l++) lane[l] += work[c + l] * xm[c + l];
            float sum = 0.0f;
            for (int l = 0; l < 16; l++) sum += lane[l];
            y[m * n + id] = sum;
        }
    }
    return 0;
}
