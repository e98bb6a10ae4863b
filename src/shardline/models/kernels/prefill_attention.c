/* Prefill attention: a prefill chunk's rows, each over the keys of its slot up to its own
 * position (causal), in bfloat16 with float32 softmax (see
 * shardline/models/prefill_attention.py, which decides where this runs; the reference is
 * torch's scaled_dot_product_attention with the same mask).
 *
 * For query row i (position p = start + i) and query head h (reading KV head h / group):
 *
 *   s_j = (q . k_j) * scale          j = 0 .. p; bfloat16 products summed in float32
 *                                    (vdpbf16ps), over the head a pair of dims at a time
 *   w_j = e^(s_j - m)                online softmax (Milakov & Gimelshein 2018) over
 *                                    blocks of KEY_BLOCK keys counted from position 0,
 *                                    in float32
 *   out = bf(sum_j bf(w_j) v_j / sum_j w_j)   the weights rounded to bfloat16 (as
 *                                    torch's bfloat16 attention rounds them), summed
 *                                    into the values in float32 (vdpbf16ps)
 *
 * Why this and not torch's flash attention: a row's bits here depend on its query, its
 * position and the keys and values up to it, nothing else: the key blocks start at
 * position 0, a block's keys past the row weigh exactly 0 and add nothing, and each row
 * runs the same instructions in the same order whatever rows share its chunk and where
 * the chunk starts or ends. (torch's depends on how many keys the chunk reads: see
 * parallel/stage.py span_keys.) A resumed prompt then needs no key span, and reads no
 * key past its rows. Speed: the keys of a block are scored against a tile of query rows
 * and heads at once, 16 keys a vdpbf16ps (keys transposed into pairs of dims), and the
 * values of two keys summed into 16 dims a vdpbf16ps (values interleaved by key pairs;
 * keys and values transposed once a call, for every tile); see prefill_attention.py for
 * what it gains over torch's.
 *
 * Threads (OpenMP) take (KV head, tile of rows) tasks, dynamically (later rows read
 * more keys); a row is computed by one task alone. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

int prefill_attention_built(void) { return 1; }

#define KEY_BLOCK 64   /* keys a block: 4 vectors of 16 scores */
#define TILE_HEADS 24  /* query vectors (rows x group heads) a task, at most */
#define MAX_TILE 32    /* query vectors a task holds, at most: whole groups of QV */
#define QV 4           /* query vectors scored together (16 float32 accumulators) */
_Static_assert(MAX_TILE % QV == 0, "a task's query vectors are scored QV at a time");
/* A loaded vector kept in a register for the instructions that use it (GCC otherwise
 * loads it again for each, and the loads, not the products, bound the loop). */
#define HELD(x) __asm__("" : "+v"(x))
#define MAX_HD 256

/* e^x for x <= 0 (clamped at -87), within ~3e-6 relative: x = n ln 2 + r, |r| <= ln 2 / 2,
 * e^r by its Taylor polynomial of degree 5 (error under r^6 / 720), 2^n added to the
 * exponent's bits (n rounded by the 1.5 x 2^23 shift). Weights are rounded to bfloat16
 * (2^-9) before they weigh the values, so that error is well below theirs. */
static inline __m512 exp16n(__m512 x) {
    const __m512 shift = _mm512_set1_ps(12582912.0f);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), shift);
    __m512 n = _mm512_sub_ps(t, shift);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 120.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_castps_si512(t), 23);
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
}

/* Keys 0 .. end - 1 of one KV head (K: [positions, hd]) as blocks of KEY_BLOCK keys,
 * each [hd / 2][KEY_BLOCK] pairs of dims (a key's dims 2d and 2d + 1 in one 32-bit
 * lane), keys past end 0: kt [blocks][hd / 2][KEY_BLOCK]. */
static void transpose_keys(const uint16_t *K, int64_t end, int64_t hd, uint32_t *kt) {
    int64_t pairs = hd / 2;
    for (int64_t k0 = 0; k0 < end; k0 += KEY_BLOCK) {
        uint32_t *block = kt + (k0 / KEY_BLOCK) * pairs * KEY_BLOCK;
        for (int64_t j = 0; j < KEY_BLOCK; j++) {
            if (k0 + j < end) {
                const uint32_t *kj = (const uint32_t *)(K + (k0 + j) * hd);
                for (int64_t d = 0; d < pairs; d++) block[d * KEY_BLOCK + j] = kj[d];
            } else {
                for (int64_t d = 0; d < pairs; d++) block[d * KEY_BLOCK + j] = 0;
            }
        }
    }
}

/* Values 0 .. end - 1 of one KV head (V: [positions, hd]) as blocks of KEY_BLOCK keys,
 * each [KEY_BLOCK / 2][hd] pairs of keys (dim d of keys j and j + 1 in one 32-bit lane),
 * keys past end 0: vt [blocks][KEY_BLOCK / 2][hd]. */
static void transpose_values(const uint16_t *V, int64_t end, int64_t hd, uint32_t *vt) {
    const __m512i pair_index = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    int64_t vecs = hd / 16;
    for (int64_t k0 = 0; k0 < end; k0 += KEY_BLOCK) {
        uint32_t *block = vt + (k0 / KEY_BLOCK) * (KEY_BLOCK / 2) * hd;
        for (int64_t j = 0; j < KEY_BLOCK; j += 2)
            for (int64_t d = 0; d < vecs; d++) {
                __m256i a = k0 + j < end ? _mm256_loadu_si256((const __m256i *)(V + (k0 + j) * hd + 16 * d))
                                         : _mm256_setzero_si256();
                __m256i b = k0 + j + 1 < end ? _mm256_loadu_si256((const __m256i *)(V + (k0 + j + 1) * hd + 16 * d))
                                             : _mm256_setzero_si256();
                __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
                _mm512_store_si512(block + (j / 2) * hd + 16 * d, _mm512_permutexvar_epi16(pair_index, both));
            }
    }
}

/* One task: rows r0 .. r0 + rows - 1 of the chunk, the `group` query heads of KV head
 * kvh. q: [n, q_stride] bfloat16 (a row's heads, hd each); kt, vt: the KV head's keys
 * and values (transpose_keys, transpose_values); out: [n, heads, hd].
 *
 * Every query vector (row, head) of the task runs every block up to the task's last row
 * alike, its keys past its row weighing exactly 0 (scores -inf, weights 0, values past
 * the chunk 0): x + 0 * v is x, and no accumulator is -0 (a block whose rescale is 0
 * zeroes it), so a row's bits are those of its own keys whatever the task. The softmax
 * steps of QV query vectors run side by side, each in its own lanes. */
static inline __attribute__((always_inline)) void tile_body(
        const uint16_t *q, int64_t q_stride, int64_t heads, int64_t group, int64_t kvh,
        const uint32_t *kt, const uint32_t *vt, int64_t start, int64_t r0, int64_t rows,
        int64_t hd, float scale, uint16_t *out) {
    uint32_t pp[MAX_TILE][KEY_BLOCK / 2];                      /* weights' bfloat16 pairs */
    float acc[MAX_TILE][MAX_HD] __attribute__((aligned(64)));
    uint32_t qp[MAX_TILE][MAX_HD / 2];                         /* query dim pairs */
    float keep[MAX_TILE], best[MAX_TILE];
    __m512 total[MAX_TILE];
    int64_t last[MAX_TILE]; /* each query vector's last key (its row's position) */
    int64_t nq = rows * group, pairs = hd / 2, vecs = hd / 16;
    for (int64_t t = 0; t < nq; t++) {
        int64_t r = r0 + t / group, h = kvh * group + t % group;
        memcpy(qp[t], q + r * q_stride + h * hd, (size_t)hd * 2);
        for (int64_t d = 0; d < hd; d++) acc[t][d] = 0.0f;
        total[t] = _mm512_setzero_ps();
        best[t] = -INFINITY;
        last[t] = start + r;
    }
    for (int64_t t = nq; t < MAX_TILE; t++) { /* a last group of QV's idle vectors */
        memset(qp[t], 0, sizeof qp[t]);
        best[t] = -INFINITY;
        last[t] = -1;
    }
    int64_t end = start + r0 + rows; /* keys 0 .. end - 1 are read */
    const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    const __m512 cut = _mm512_set1_ps(-60.0f);
    for (int64_t k0 = 0; k0 < end; k0 += KEY_BLOCK) {
        const uint32_t *kb = kt + (k0 / KEY_BLOCK) * pairs * KEY_BLOCK;
        const uint32_t *vb = vt + (k0 / KEY_BLOCK) * (KEY_BLOCK / 2) * hd;
        /* scores, QV query vectors x 64 keys at a time, then their softmax steps */
        for (int64_t t0 = 0; t0 < nq; t0 += QV) {
            __m512 s[QV][4];
            for (int i = 0; i < QV; i++)
                for (int v = 0; v < 4; v++) s[i][v] = _mm512_setzero_ps();
            for (int64_t d = 0; d < pairs; d++) {
                __m512bh k[4];
                for (int v = 0; v < 4; v++) {
                    k[v] = (__m512bh)_mm512_load_si512(kb + d * KEY_BLOCK + 16 * v);
                    HELD(k[v]);
                }
                for (int i = 0; i < QV; i++) {
                    __m512bh qd = (__m512bh)_mm512_set1_epi32((int)qp[t0 + i][d]);
                    for (int v = 0; v < 4; v++) s[i][v] = _mm512_dpbf16_ps(s[i][v], k[v], qd);
                }
            }
            /* each vector's largest score so far, in lane i (lanes QV.. idle) */
            __mmask16 m[QV][4];
            float most[16] __attribute__((aligned(64))), was[16] __attribute__((aligned(64)));
            for (int i = 0; i < 16; i++) most[i] = was[i] = 0.0f;
            for (int i = 0; i < QV; i++) {
                was[i] = best[t0 + i];
                int64_t seen = last[t0 + i] - k0 + 1;
                __m512 top = ninf;
                for (int v = 0; v < 4; v++) {
                    int64_t c = seen - 16 * v;
                    m[i][v] = c >= 16 ? 0xFFFF : c <= 0 ? 0 : (__mmask16)((1u << c) - 1);
                    s[i][v] = _mm512_mask_mul_ps(ninf, m[i][v], s[i][v], sc);
                    top = _mm512_max_ps(top, s[i][v]);
                }
                most[i] = _mm512_reduce_max_ps(top);
            }
            __m512 before = _mm512_load_ps(was), now = _mm512_max_ps(before, _mm512_load_ps(most));
            /* the rescale e^(was - now): 0 for the first block (was -inf), 1 where no key
             * is live (now is was) */
            __mmask16 seen_any = _mm512_cmp_ps_mask(before, ninf, _CMP_NEQ_OQ);
            __m512 kp4 = _mm512_maskz_mov_ps(seen_any, exp16n(_mm512_maskz_sub_ps(seen_any, before, now)));
            float nowf[16] __attribute__((aligned(64))), kpf[16] __attribute__((aligned(64)));
            _mm512_store_ps(nowf, now);
            _mm512_store_ps(kpf, kp4);
            for (int i = 0; i < QV && t0 + i < nq; i++) {
                int64_t t = t0 + i;
                keep[t] = kpf[i];
                best[t] = nowf[i];
                __m512 mv = _mm512_set1_ps(nowf[i]), sum = total[t], w[4];
                if (kpf[i] != 1.0f) sum = _mm512_mul_ps(sum, _mm512_set1_ps(kpf[i]));
                for (int v = 0; v < 4; v++) {
                    /* below e^-60 (relative to the largest, 1) a weight is 0: no denormals */
                    __m512 x = _mm512_sub_ps(s[i][v], mv);
                    w[v] = _mm512_maskz_mov_ps(m[i][v] & _mm512_cmp_ps_mask(x, cut, _CMP_GE_OQ), exp16n(x));
                    sum = _mm512_add_ps(sum, w[v]);
                }
                total[t] = sum;
                for (int v = 0; v < 4; v += 2) /* bfloat16 pairs (j, j + 1), round to nearest */
                    _mm512_storeu_si512(pp[t] + 8 * v, (__m512i)_mm512_cvtne2ps_pbh(w[v + 1], w[v]));
            }
        }
        /* weighted values: QB query vectors at a time over the block's keys */
        const int64_t qb = vecs <= 4 ? 4 : vecs <= 8 ? 2 : 1;
        for (int64_t t0 = 0; t0 < nq; t0 += qb) {
            int64_t nb = nq - t0 < qb ? nq - t0 : qb;
            __m512 a[4][MAX_HD / 16];
            for (int64_t i = 0; i < nb; i++) {
                __m512 kp = _mm512_set1_ps(keep[t0 + i]);
                for (int64_t d = 0; d < vecs; d++) /* (x 1 leaves x's bits) */
                    a[i][d] = keep[t0 + i] == 0.0f   ? _mm512_setzero_ps()
                              : keep[t0 + i] == 1.0f ? _mm512_load_ps(acc[t0 + i] + 16 * d)
                                                     : _mm512_mul_ps(_mm512_load_ps(acc[t0 + i] + 16 * d), kp);
            }
            if (vecs <= 8 && nb == qb) {
                for (int64_t j = 0; j < KEY_BLOCK / 2; j++) {
                    __m512bh vv[8], w[4];
                    for (int64_t d = 0; d < vecs; d++) {
                        vv[d] = (__m512bh)_mm512_load_si512(vb + j * hd + 16 * d);
                        HELD(vv[d]);
                    }
                    for (int64_t i = 0; i < qb; i++) {
                        w[i] = (__m512bh)_mm512_set1_epi32((int)pp[t0 + i][j]);
                        HELD(w[i]);
                    }
                    for (int64_t i = 0; i < qb; i++)
                        for (int64_t d = 0; d < vecs; d++) a[i][d] = _mm512_dpbf16_ps(a[i][d], vv[d], w[i]);
                }
            } else {
                for (int64_t j = 0; j < KEY_BLOCK / 2; j++) {
                    for (int64_t d = 0; d < vecs; d++) {
                        __m512bh vv = (__m512bh)_mm512_load_si512(vb + j * hd + 16 * d);
                        for (int64_t i = 0; i < nb; i++)
                            a[i][d] = _mm512_dpbf16_ps(a[i][d], vv, (__m512bh)_mm512_set1_epi32((int)pp[t0 + i][j]));
                    }
                }
            }
            for (int64_t i = 0; i < nb; i++)
                for (int64_t d = 0; d < vecs; d++) _mm512_store_ps(acc[t0 + i] + 16 * d, a[i][d]);
        }
    }
    for (int64_t t = 0; t < nq; t++) {
        int64_t r = r0 + t / group, h = kvh * group + t % group;
        __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total[t]));
        for (int64_t d = 0; d < vecs; d++)
            _mm256_storeu_si256((__m256i *)(out + (r * heads + h) * hd + 16 * d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc[t] + 16 * d), inv)));
    }
}

/* tile_body for one head size: the compiler unrolls the loops over the head (the same
 * operations in the same order: the same bits). */
#define TILE_FOR(HD)                                                                          \
    static void tile_##HD(const uint16_t *q, int64_t q_stride, int64_t heads, int64_t group,   \
                          int64_t kvh, const uint32_t *kt, const uint32_t *vt, int64_t start,  \
                          int64_t r0, int64_t rows, float scale, uint16_t *out) {              \
        tile_body(q, q_stride, heads, group, kvh, kt, vt, start, r0, rows, HD, scale, out);   \
    }
TILE_FOR(64)
TILE_FOR(128)

/* out [n, heads, hd] = the causal attention of query rows q ([n, q_stride] bfloat16, row
 * i at position start + i, heads of hd each) over the cache of one slot, K and V
 * ([kv_heads, positions, hd] bfloat16, kv_stride elements between KV heads), where the
 * chunk's own keys and values are already written. hd a multiple of 32, at most MAX_HD;
 * heads a multiple of kv_heads, heads / kv_heads at most MAX_TILE. Returns 0, -1 for a
 * shape it does not take, -2 where memory for the transposed keys is short (nothing
 * written either way). */
int prefill_attention(const uint16_t *q, int64_t n, int64_t q_stride, int64_t heads,
                      const uint16_t *K, const uint16_t *V, int64_t kv_heads, int64_t kv_stride,
                      int64_t start, int64_t hd, float scale, uint16_t *out) {
    if (hd % 32 || hd > MAX_HD || kv_heads <= 0 || heads % kv_heads || n <= 0) return -1;
    int64_t group = heads / kv_heads;
    if (group > MAX_TILE) return -1;
    int64_t end = start + n, blocks = (end + KEY_BLOCK - 1) / KEY_BLOCK;
    int64_t per_head = blocks * (hd / 2) * KEY_BLOCK;
    uint32_t *kt = aligned_alloc(64, (size_t)(2 * kv_heads * per_head * 4));
    if (!kt) return -2;
    uint32_t *vt = kt + kv_heads * per_head;
#pragma omp parallel for schedule(static) if (!in_parallel())
    for (int64_t task = 0; task < 2 * kv_heads; task++) {
        int64_t kvh = task / 2;
        if (task % 2)
            transpose_values(V + kvh * kv_stride, end, hd, vt + kvh * per_head);
        else
            transpose_keys(K + kvh * kv_stride, end, hd, kt + kvh * per_head);
    }
    int64_t rows = TILE_HEADS / group > 0 ? TILE_HEADS / group : 1;
    int64_t tiles = (n + rows - 1) / rows, tasks = tiles * kv_heads;
#pragma omp parallel for schedule(dynamic, 1) if (tasks > 1 && !in_parallel())
    for (int64_t task = 0; task < tasks; task++) {
        /* the last tiles (most keys) first */
        int64_t tile = tiles - 1 - task / kv_heads, kvh = task % kv_heads;
        int64_t r0 = tile * rows, m = n - r0 < rows ? n - r0 : rows;
        const uint32_t *kh = kt + kvh * per_head;
        const uint32_t *vh = vt + kvh * per_head;
        if (hd == 64)
            tile_64(q, q_stride, heads, group, kvh, kh, vh, start, r0, m, scale, out);
        else if (hd == 128)
            tile_128(q, q_stride, heads, group, kvh, kh, vh, start, r0, m, scale, out);
        else
            tile_body(q, q_stride, heads, group, kvh, kh, vh, start, r0, m, hd, scale, out);
    }
    free(kt);
    return 0;
}

#else /* not built: prefill_attention.py calls it only where prefill_attention_built() */
int prefill_attention_built(void) { return 0; }
int prefill_attention(const uint16_t *q, int64_t n, int64_t q_stride, int64_t heads,
                      const uint16_t *K, const uint16_t *V, int64_t kv_heads, int64_t kv_stride,
                      int64_t start, int64_t hd, float scale, uint16_t *out) {
    (void)q; (void)n; (void)q_stride; (void)heads; (void)K; (void)V; (void)kv_heads;
    (void)kv_stride; (void)start; (void)hd; (void)scale; (void)out;
    return -1;
}
#endif
