/* Fused decode layers: a decode step's decoder layers in one call (see
 * shardline/models/fused_decode.py, which decides where this runs, and
 * shardline/models/llama.py, whose torch code is the reference it follows op for op).
 *
 * For each layer and each row (one sequence's new token) of the step, in bfloat16 with
 * the rounding points of the torch code:
 *
 *   h  = rms_norm(x) * w1                (normalized in float32, rounded, scaled, rounded)
 *   qkv = h @ Wqkv^T (+ bias)            (int4_planes_gemv, int4_gemv.c, or for a part of
 *                                        packed 5/6-bit groups packed_groups_q8_gemv,
 *                                        packed_groups.c, or of dense bfloat16 values
 *                                        dense_bf16_gemv, dense_gemv.c, rounded to
 *                                        bfloat16)
 *   q, k = rms_norm per head (Qwen3), then RoPE: bf(bf(a * cos) + bf(rot(a) * sin))
 *   k, v -> the slot's cache at the row's position ([slots, kv_heads, positions, hd])
 *   a  = softmax(q k^T / sqrt(hd)) v     over positions 0 .. position, in float32
 *                                        (online softmax, Milakov & Gimelshein 2018),
 *                                        query head h reading KV head h / group
 *   x  = bf(x + a @ Wo^T)
 *   h  = rms_norm(x) * w2;  g, u = h @ Wgu^T;  x = bf(x + bf(bf(silu(g)) * u) @ Wd^T)
 *
 * or, for a mixture-of-experts layer (feed_forward.MixtureOfExperts), after the same norm:
 *
 *   logits = float(h @ R^T in float64); p = softmax(logits) in float32; the top k of p
 *   (renormalized to sum 1 where norm_topk); for each expert e any row chose, ascending,
 *   on the rows that chose it: y_e = (bf(bf(silu(g)) * u) @ Wd_e^T as above, e's weights);
 *   acc[row] += float(y_e) * p_e (a float32 product, then a float32 add);
 *   x = bf(x + bf(acc))
 *
 * gpt-oss's parts (transformers' GptOssAttention and GptOssExperts): a sliding window on
 * some layers (a row attends positions position - window + 1 .. position), a sink logit a
 * head that joins its softmax's sum and weighs no value, biases on o (bf(y + b), as
 * Linear adds one), the router (added in float64) and each expert's gate_up and down,
 * and the clamped SwiGLU (see swiglu()).
 *
 * Each row is computed by the same instructions in the same order whatever the other
 * rows of the step (the products guarantee it, and everything else is per row), so its
 * result is the same bits in any batch. Threads (OpenMP) split the products' output
 * blocks and the attention's (row, KV head, block of SPLIT keys) tasks; a row's blocks
 * depend on its length alone and are combined in order (flash-decoding's split of the
 * keys, Dao et al. 2023). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"

#if defined(__AVX512BF16__) && INT4_GEMV_BUILT
#include <immintrin.h>

int decode_layers_built(void) { return 1; }

/* One row block of a product's weight: int4 planes, packed 5/6-bit groups or dense
 * bfloat16 values (the others NULL). */
typedef struct {
    const int4_gemv_t *int4;
    const packed_groups_t *packed;
    const dense_t *dense;
} product_part_t;

#define MAX_PARTS 3
/* A product's weight: its parts' rows stacked, top to bottom (a fused q/k/v whose v the
 * file stores in another type has two). */
typedef struct {
    int64_t count;
    product_part_t part[MAX_PARTS];
} product_t;

/* One layer's weights and cache (bfloat16 vectors; NULL where the model has none). A
 * mixture-of-experts layer has no gate_up and down but a router and experts. */
typedef struct {
    const product_t *qkv, *o, *gate_up, *down;
    const uint16_t *attn_norm, *mlp_norm; /* [hidden] */
    const uint16_t *qkv_bias;             /* [(heads + 2 kv_heads) hd] or NULL */
    const uint16_t *q_norm, *k_norm;      /* [hd] or NULL */
    uint16_t *k_cache, *v_cache;          /* [slots, kv_heads, positions, hd] */
    const float *router;                  /* [experts, hidden] or NULL */
    const product_t *experts;             /* [experts][2]: gate_up, down; or NULL */
    /* gpt-oss's: */
    const float *sinks;                   /* [heads] a logit each head's softmax adds, or NULL */
    const double *router_bias;            /* [experts] or NULL */
    const uint16_t *o_bias;               /* [hidden] or NULL */
    const uint16_t *gate_up_bias;         /* [experts or 1, 2 inter] or NULL */
    const uint16_t *down_bias;            /* [experts or 1, hidden] or NULL */
    int64_t window;                       /* keys a query sees, its own included; 0: all */
} decode_layer_t;

/* The model's sizes (hidden and hd multiples of 16, hd at most MAX_HD, heads / kv_heads
 * at most MAX_GROUP; inter an expert's width in a mixture of experts, which has experts
 * > 0 of which each row takes top_k). */
typedef struct {
    int64_t hidden, heads, kv_heads, hd, inter, slots, positions, experts, top_k, norm_topk;
    float eps;
    float swiglu_limit, swiglu_alpha; /* limit > 0: gpt-oss's clamped SwiGLU */
} decode_shape_t;

#define MAX_HD 256
#define MAX_GROUP 16 /* query heads a KV head serves */
#define CHUNK 128 /* keys scored at a time */
#define SPLIT 512 /* keys a thread takes: a row's keys split in blocks by its length alone */

/* v rounded to bfloat16 (round to nearest even), back in float32. */
static inline __m512 round16(__m512 v) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* e^x for x in [-87, 88] (clamped), Cephes' expf polynomial: within 2 float32 ulp. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* out = bf(w * bf(x / sqrt(mean(x^2) + eps))), n a multiple of 16 (RMSNorm of llama.py). */
static void rms_norm(const uint16_t *x, const uint16_t *w, int64_t n, float eps,
                     uint16_t *out) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __m512 v = from_bf16_16(x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)n + eps));
    for (int64_t i = 0; i < n; i += 16) /* bf(w * bf(x * r)): vcvtneps2bf16 rounds as to_bf16 */
        _mm256_storeu_si256((__m256i *)(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(
                                from_bf16_16(w + i), round16(_mm512_mul_ps(from_bf16_16(x + i), r)))));
}

static inline float sum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}

/* sum8 of each of d[0..7], in key order, each summed in sum8's order (lanes i and i + 4,
 * then i and i + 2, then 0 and 1: the same additions, the same bits), with the
 * transposes of an 8 x 8 reduction: ~2.6 operations a key where sum8 takes ~6. With it
 * attend_body's scores take 8 keys a head at once: one call over 1,800 keys (a 2-vCPU
 * AMD EPYC VM, one thread, 2026-12-07) 8.6 -> 5.4 us for 64 x 3, 28.6 -> 20.7 us for
 * 128 x 6; SmolLM2's decode step at 1,800 positions 13.65 -> 12.67 ms for 9 rows (one
 * sequence's 8 drafted tokens), 4.79 -> 4.73 ms for one; the same logits. */
static inline __m256 sum8x8(const __m256 d[8]) {
    __m256 p[4];
    for (int i = 0; i < 4; i++) /* [lanes i + i+4 of d[2i] | of d[2i+1]] */
        p[i] = _mm256_add_ps(_mm256_permute2f128_ps(d[2 * i], d[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(d[2 * i], d[2 * i + 1], 0x31));
    __m256 q0 = _mm256_add_ps(_mm256_shuffle_ps(p[0], p[1], 0x44), _mm256_shuffle_ps(p[0], p[1], 0xEE));
    __m256 q1 = _mm256_add_ps(_mm256_shuffle_ps(p[2], p[3], 0x44), _mm256_shuffle_ps(p[2], p[3], 0xEE));
    __m256 r = _mm256_add_ps(_mm256_shuffle_ps(q0, q1, 0x88), _mm256_shuffle_ps(q0, q1, 0xDD));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)); /* keys 0, 2, 4, 6 | 1, 3, 5, 7 -> 0..7 */
}

/* The query heads of one KV head (group of them, q16: group x hd bfloat16) of one row
 * over L keys (K, V: hd bfloat16 a key), each key and value read once for the group:
 * per head g, part[g] = (m, l, a[hd]) with m the largest score q[g] k * scale, l the sum
 * of e^(score - m) and a the sum of e^(score - m) v, in float32. Scores: bfloat16
 * products (exact in float32) summed in float32 (vdpbf16ps). */
static inline __attribute__((always_inline)) void attend_body(
        const uint16_t *q16, int64_t group, const uint16_t *K, const uint16_t *V, int64_t L,
        int64_t hd, float scale, float *part) {
    __m256bh q[MAX_GROUP][MAX_HD / 16];
    __m512 acc[MAX_GROUP][MAX_HD / 16];
    float s[MAX_GROUP][CHUNK] __attribute__((aligned(64)));
    float best[MAX_GROUP], total[MAX_GROUP];
    int64_t vecs = hd / 16;
    for (int64_t g = 0; g < group; g++) {
        for (int64_t d = 0; d < vecs; d++) {
            q[g][d] = (__m256bh)_mm256_loadu_si256((const __m256i *)(q16 + g * hd + 16 * d));
            acc[g][d] = _mm512_setzero_ps();
        }
        best[g] = -INFINITY;
        total[g] = 0.0f;
    }
    for (int64_t t0 = 0; t0 < L; t0 += CHUNK) {
        int64_t n = L - t0 < CHUNK ? L - t0 : CHUNK;
        float top[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) top[g] = -INFINITY;
        int64_t t = 0;
        for (; t + 8 <= n; t += 8) { /* 8 keys a head at once, each as the loop below scores it */
            const uint16_t *k = K + (t0 + t) * hd;
            for (int64_t g = 0; g < group; g++) {
                __m256 dot[8];
                for (int j = 0; j < 8; j++) {
                    dot[j] = _mm256_setzero_ps();
                    for (int64_t d = 0; d < vecs; d++)
                        dot[j] = _mm256_dpbf16_ps(
                            dot[j], q[g][d], (__m256bh)_mm256_loadu_si256((const __m256i *)(k + j * hd + 16 * d)));
                }
                __m256 v = _mm256_mul_ps(sum8x8(dot), _mm256_set1_ps(scale));
                _mm256_store_ps(s[g] + t, v);
                __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                m = _mm_max_ps(m, _mm_movehl_ps(m, m));
                float most = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
                top[g] = most > top[g] ? most : top[g];
            }
        }
        for (; t < n; t++) {
            const uint16_t *k = K + (t0 + t) * hd;
            __m256bh kv[MAX_HD / 16];
            for (int64_t d = 0; d < vecs; d++)
                kv[d] = (__m256bh)_mm256_loadu_si256((const __m256i *)(k + 16 * d));
            for (int64_t g = 0; g < group; g++) {
                __m256 dot = _mm256_setzero_ps();
                for (int64_t d = 0; d < vecs; d++) dot = _mm256_dpbf16_ps(dot, q[g][d], kv[d]);
                float v = sum8(dot) * scale;
                s[g][t] = v;
                top[g] = v > top[g] ? v : top[g];
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float now = top[g] > best[g] ? top[g] : best[g];
            float keep = expf(best[g] - now); /* 0 for the first chunk */
            best[g] = now;
            __m512 sum = _mm512_setzero_ps(), m = _mm512_set1_ps(now);
            for (int64_t t = 0; t < n; t += 16) {
                __mmask16 live = n - t >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t)) - 1);
                /* below e^-60 (relative to the largest, 1) a weight is 0: no denormals */
                __m512 x = _mm512_sub_ps(_mm512_load_ps(s[g] + t), m);
                live &= _mm512_cmp_ps_mask(x, _mm512_set1_ps(-60.0f), _CMP_GE_OQ);
                __m512 p = _mm512_maskz_mov_ps(live, exp16(x));
                _mm512_store_ps(s[g] + t, p);
                sum = _mm512_add_ps(sum, p);
            }
            total[g] = total[g] * keep + _mm512_reduce_add_ps(sum);
            __m512 kp = _mm512_set1_ps(keep);
            for (int64_t d = 0; d < vecs; d++) acc[g][d] = _mm512_mul_ps(acc[g][d], kp);
        }
        for (int64_t t = 0; t < n; t++) {
            const uint16_t *v = V + (t0 + t) * hd;
            __m512 vv[MAX_HD / 16];
            for (int64_t d = 0; d < vecs; d++) vv[d] = from_bf16_16(v + 16 * d);
            for (int64_t g = 0; g < group; g++) {
                __m512 p = _mm512_set1_ps(s[g][t]);
                for (int64_t d = 0; d < vecs; d++) acc[g][d] = _mm512_fmadd_ps(p, vv[d], acc[g][d]);
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *pg = part + g * (hd + 2);
        pg[0] = best[g];
        pg[1] = total[g];
        for (int64_t d = 0; d < vecs; d++) _mm512_storeu_ps(pg + 2 + 16 * d, acc[g][d]);
    }
}

/* attend_body for one head size and group: the compiler unrolls its loops over the head
 * and the group and keeps q and the accumulators in registers, the same operations in the
 * same order (the same bits). SmolLM2's 64 x 3 over 2,048 keys, one thread: 14.2 us a call
 * against 27.6 us with both known only at run time (128 x 6: 14.6 against 19.1 us). */
#define ATTEND_FOR(HD, G)                                                                   \
    static void attend_##HD##_##G(const uint16_t *q16, const uint16_t *K, const uint16_t *V, \
                                  int64_t L, float scale, float *part) {                    \
        attend_body(q16, G, K, V, L, HD, scale, part);                                      \
    }
#define ATTEND_GROUPS(HD) \
    ATTEND_FOR(HD, 1) ATTEND_FOR(HD, 2) ATTEND_FOR(HD, 3) ATTEND_FOR(HD, 4) \
    ATTEND_FOR(HD, 5) ATTEND_FOR(HD, 6) ATTEND_FOR(HD, 7) ATTEND_FOR(HD, 8)
ATTEND_GROUPS(64)
ATTEND_GROUPS(128)

typedef void (*attend_fn)(const uint16_t *, const uint16_t *, const uint16_t *, int64_t, float, float *);
static const attend_fn ATTEND_64[8] = {attend_64_1, attend_64_2, attend_64_3, attend_64_4,
                                       attend_64_5, attend_64_6, attend_64_7, attend_64_8};
static const attend_fn ATTEND_128[8] = {attend_128_1, attend_128_2, attend_128_3, attend_128_4,
                                        attend_128_5, attend_128_6, attend_128_7, attend_128_8};

/* attend_body, specialized where the head size is 64 or 128 and the group at most 8. */
static void attend(const uint16_t *q16, int64_t group, const uint16_t *K, const uint16_t *V,
                   int64_t L, int64_t hd, float scale, float *part) {
    if ((hd == 64 || hd == 128) && group >= 1 && group <= 8)
        (hd == 64 ? ATTEND_64 : ATTEND_128)[group - 1](q16, K, V, L, scale, part);
    else
        attend_body(q16, group, K, V, L, hd, scale, part);
}

/* out[hd] (bfloat16) = the attention of one query head from its blocks' parts (each
 * (m, l, a[hd]), `stride` floats apart), combined in block order, with the head's sink
 * logit (-INFINITY: none) in the softmax's sum and no value. */
static void combine(const float *part, int64_t blocks, int64_t stride, int64_t hd, float sink,
                    uint16_t *out) {
    float best = part[0] > sink ? part[0] : sink;
    for (int64_t b = 1; b < blocks; b++) best = part[b * stride] > best ? part[b * stride] : best;
    float total = expf(sink - best); /* 0 without a sink */
    __m512 acc[MAX_HD / 16];
    for (int64_t d = 0; d < hd / 16; d++) acc[d] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const float *pb = part + b * stride;
        float w = expf(pb[0] - best);
        total += pb[1] * w;
        for (int64_t d = 0; d < hd / 16; d++)
            acc[d] = _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(pb + 2 + 16 * d), acc[d]);
    }
    __m512 inv = _mm512_set1_ps(1.0f / total);
    for (int64_t d = 0; d < hd / 16; d++)
        _mm256_storeu_si256((__m256i *)(out + 16 * d),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[d], inv)));
}

/* In place on a row's q and k heads (heads + kv_heads of hd): the per-head norms (if
 * any), then RoPE with the row's bfloat16 cos and sin [hd] (sin's first half negated). */
static void norm_and_rope(const decode_shape_t *S, const decode_layer_t *Lr, uint16_t *qk,
                          const uint16_t *cos, const uint16_t *sin) {
    int64_t hd = S->hd, half = hd / 2;
    uint16_t a[MAX_HD];
    for (int64_t h = 0; h < S->heads + S->kv_heads; h++) {
        uint16_t *x = qk + h * hd;
        const uint16_t *w = h < S->heads ? Lr->q_norm : Lr->k_norm;
        if (w) rms_norm(x, w, hd, S->eps, x);
        memcpy(a, x, (size_t)hd * 2);
        int64_t d = 0;
        if (half % 16 == 0) /* 16 lanes never straddle the halves */
            for (; d < hd; d += 16) {
                __m512 c = round16(_mm512_mul_ps(from_bf16_16(a + d), from_bf16_16(cos + d)));
                __m512 r = round16(_mm512_mul_ps(from_bf16_16(a + (d + half) % hd), from_bf16_16(sin + d)));
                _mm256_storeu_si256((__m256i *)(x + d),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c, r)));
            }
        for (; d < hd; d++) {
            float c = from_bf16(to_bf16(from_bf16(a[d]) * from_bf16(cos[d])));
            float r = from_bf16(to_bf16(from_bf16(a[(d + half) % hd]) * from_bf16(sin[d])));
            x[d] = to_bf16(c + r);
        }
    }
}

/* y [M, N] bfloat16 = x [M, K] bfloat16 @ W^T, W = p's parts stacked: each int4 part's
 * output as int4_planes_gemv rounds it, each packed or dense part's float32 product
 * (packed_groups_q8_gemv, dense_bf16_gemv) rounded to bfloat16: the torch path's Linear,
 * part by part. Returns 0, or -1 without memory. */
static inline int64_t part_rows(const product_part_t *part) {
    return part->int4 ? part->int4->N : part->packed ? part->packed->rows : part->dense->N;
}

static int product(const product_t *p, const uint16_t *x, int64_t M, uint16_t *y, int64_t N) {
    if (p->count == 1 && p->part[0].int4) return int4_planes_gemv(p->part[0].int4, x, 0, M, y);
    int64_t most = 0;
    for (int64_t i = 0; i < p->count; i++) {
        int64_t rows = part_rows(p->part + i);
        most = rows > most ? rows : most;
    }
    float *out = malloc((size_t)(M * most) * sizeof(float));
    if (!out) return -1;
    int rc = 0;
    for (int64_t i = 0, at = 0; i < p->count && !rc; i++) {
        const product_part_t *part = p->part + i;
        int64_t rows = part_rows(part);
        if (part->int4) { /* bfloat16 rows, in out's space */
            uint16_t *o16 = (uint16_t *)out;
            if (!(rc = int4_planes_gemv(part->int4, x, 0, M, o16)))
                for (int64_t m = 0; m < M; m++)
                    memcpy(y + m * N + at, o16 + m * rows, (size_t)rows * 2);
        } else if (!(rc = part->packed ? packed_groups_q8_gemv(part->packed, x, 0, M, out)
                                       : dense_bf16_gemv(part->dense, x, M, out))) {
            for (int64_t m = 0; m < M; m++)
                for (int64_t r = 0; r < rows; r++) y[m * N + at + r] = to_bf16(out[m * rows + r]);
        }
        at += rows;
    }
    free(out);
    return rc;
}

/* x = bf(x + y), n a multiple of 16. */
static inline void add_rows(uint16_t *x, const uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i += 16)
        _mm256_storeu_si256((__m256i *)(x + i), (__m256i)_mm512_cvtneps_pbh(
                                _mm512_add_ps(from_bf16_16(x + i), from_bf16_16(y + i))));
}

/* act [M, inter] = bf(bf(silu(g)) * u) of gu [M, 2 inter] (each row's g then u; first
 * bf(gu + bias) where a bias [2 inter] is given, in place), or
 * where limit > 0 gpt-oss's clamped SwiGLU (feed_forward.MLP), rounded where its bfloat16
 * torch ops round: g = min(g, limit), u = clamp(u, -limit, limit),
 * bf(bf(u + 1) * bf(g * bf(sigmoid(bf(g * alpha))))). */
static void swiglu(uint16_t *gu, int64_t M, int64_t inter, const uint16_t *bias, float limit,
                   float alpha, uint16_t *act) {
    const __m512 one = _mm512_set1_ps(1.0f), hi = _mm512_set1_ps(limit), lo = _mm512_set1_ps(-limit);
    for (int64_t m = 0; m < M; m++) {
        if (bias) add_rows(gu + m * 2 * inter, bias, 2 * inter);
        const uint16_t *g = gu + m * 2 * inter, *u = g + inter;
        uint16_t *a = act + m * inter;
        if (limit > 0.0f) {
            for (int64_t i = 0; i < inter; i += 16) {
                __m512 gv = _mm512_min_ps(from_bf16_16(g + i), hi);
                __m512 uv = _mm512_max_ps(_mm512_min_ps(from_bf16_16(u + i), hi), lo);
                __m512 t = round16(_mm512_mul_ps(gv, _mm512_set1_ps(alpha)));
                __m512 sig = round16(_mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), t)))));
                __m512 glu = round16(_mm512_mul_ps(gv, sig));
                _mm256_storeu_si256((__m256i *)(a + i), (__m256i)_mm512_cvtneps_pbh(
                                        _mm512_mul_ps(round16(_mm512_add_ps(uv, one)), glu)));
            }
            continue;
        }
        for (int64_t i = 0; i < inter; i += 16) {
            __m512 gv = from_bf16_16(g + i);
            __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            _mm256_storeu_si256((__m256i *)(a + i), (__m256i)_mm512_cvtneps_pbh(
                                    _mm512_mul_ps(round16(silu), from_bf16_16(u + i))));
        }
    }
}

/* The router logits p [M, experts] of the normed rows h [M, hidden] (R [experts,
 * hidden], float32): each summed in float64 (every product exact: a float32 times a
 * bfloat16) and rounded to float32. Threads split the experts, each logit the same
 * operations on any thread. */
static void router_logits(const decode_shape_t *S, const float *R, const double *bias,
                          const uint16_t *h, int64_t M, float *p) {
    int64_t H = S->hidden, E = S->experts;
#pragma omp parallel for schedule(static)
    for (int64_t e = 0; e < E; e++) {
        const float *r = R + e * H;
        for (int64_t m = 0; m < M; m++) {
            __m512d acc = _mm512_setzero_pd();
            for (int64_t i = 0; i < H; i += 8) {
                __m512d x = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + m * H + i))), 16)));
                acc = _mm512_fmadd_pd(x, _mm512_cvtps_pd(_mm256_loadu_ps(r + i)), acc);
            }
            p[m * E + e] = (float)(_mm512_reduce_add_pd(acc) + (bias ? bias[e] : 0.0));
        }
    }
}

/* A row's experts and weights (choice, weight [top_k], the largest first) from its
 * router logits p [experts] (overwritten): softmax in float32 (exp of logit - max over
 * the sum), the top k (the lower id first among equals), divided by their sum where
 * norm_topk. */
static void route(const decode_shape_t *S, float *p, int32_t *choice, float *weight) {
    int64_t E = S->experts, K = S->top_k;
    float most = -INFINITY, total = 0.0f;
    for (int64_t e = 0; e < E; e++) most = p[e] > most ? p[e] : most;
    for (int64_t e = 0; e < E; e++) total += (p[e] = expf(p[e] - most));
    for (int64_t e = 0; e < E; e++) p[e] /= total;
    float sum = 0.0f;
    for (int64_t k = 0; k < K; k++) { /* selection: K is small */
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t j = 0; j < k; j++) taken |= choice[j] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        choice[k] = (int32_t)best;
        sum += (weight[k] = p[best]);
    }
    if (S->norm_topk)
        for (int64_t k = 0; k < K; k++) weight[k] /= sum;
}

/* y [M, hidden] = bf(the mixture of experts' output) for normed rows h [M, hidden] (see
 * the file's comment). Threads take the chosen experts (dynamic: an expert's rows vary),
 * each expert's products on one thread (the kernels' own threads stay out: nested
 * regions run alone), then each row's sum is taken over its experts in ascending order
 * as before: the same operations on each value whatever thread ran it. One region a
 * layer instead of two products' regions an expert: a Qwen3-30B-A3B-shaped step (1 row,
 * 8 experts a layer, 2 threads) spent ~18% of its threads' time at those regions'
 * barriers. Returns 0, or -1 without memory. */
static int experts(const decode_shape_t *S, const decode_layer_t *Lr, const uint16_t *h,
                   int64_t M, uint16_t *y) {
    int64_t H = S->hidden, E = S->experts, K = S->top_k, inter = S->inter;
    float *p = malloc((size_t)(M * E) * sizeof(float)), *weight = malloc((size_t)(M * K) * sizeof(float));
    float *acc = calloc((size_t)(M * H), sizeof(float));
    int32_t *choice = malloc((size_t)(M * K) * sizeof(int32_t));
    /* the chosen experts, ascending (order), the rows of the u-th at rows[first[u] ..
     * first[u + 1]) with their weights, and their outputs ys [M K, hidden] in that order */
    int32_t *order = malloc((size_t)(M * K) * sizeof(int32_t));
    int64_t *first = malloc((size_t)(M * K + 1) * sizeof(int64_t)), *rows = malloc((size_t)(M * K) * sizeof(int64_t));
    float *row_weight = malloc((size_t)(M * K) * sizeof(float));
    uint16_t *ys = malloc((size_t)(M * K * H) * 2);
    int rc = -1;
    if (!p || !weight || !acc || !choice || !order || !first || !rows || !row_weight || !ys) goto done;
    router_logits(S, Lr->router, Lr->router_bias, h, M, p);
    for (int64_t m = 0; m < M; m++) route(S, p + m * E, choice + m * K, weight + m * K);
    int64_t used = 0, n = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t at = n;
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++)
                if (choice[m * K + k] == e) {
                    rows[n] = m;
                    row_weight[n++] = weight[m * K + k];
                }
        if (n > at) {
            order[used] = (int32_t)e;
            first[used++] = at;
        }
    }
    first[used] = n;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        /* an expert's rows of h, its gate and up, its activations */
        uint16_t *hb = malloc((size_t)(M * (H + 3 * inter)) * 2), *gu = hb + M * H, *act = gu + M * 2 * inter;
        failed = hb == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < used; u++) {
            if (!hb || failed) continue;
            int64_t e = order[u], count = first[u + 1] - first[u];
            for (int64_t j = 0; j < count; j++)
                memcpy(hb + j * H, h + rows[first[u] + j] * H, (size_t)H * 2);
            uint16_t *out = ys + first[u] * H;
            if (product(Lr->experts + 2 * e, hb, count, gu, 2 * inter)) {
                failed = 1;
                continue;
            }
            swiglu(gu, count, inter, Lr->gate_up_bias ? Lr->gate_up_bias + e * 2 * inter : NULL,
                   S->swiglu_limit, S->swiglu_alpha, act);
            if (product(Lr->experts + 2 * e + 1, act, count, out, H)) {
                failed = 1;
                continue;
            }
            if (Lr->down_bias)
                for (int64_t j = 0; j < count; j++) add_rows(out + j * H, Lr->down_bias + e * H, H);
        }
        free(hb);
    }
    if (failed) goto done;
    rc = 0;
    for (int64_t j = 0; j < n; j++) { /* expert by expert, ascending; each one's rows in order */
        float *a = acc + rows[j] * H;
        __m512 w = _mm512_set1_ps(row_weight[j]);
        for (int64_t i = 0; i < H; i += 16)
            _mm512_storeu_ps(a + i, _mm512_add_ps(_mm512_loadu_ps(a + i),
                                                  _mm512_mul_ps(from_bf16_16(ys + j * H + i), w)));
    }
    for (int64_t i = 0; i < M * H; i += 16)
        _mm256_storeu_si256((__m256i *)(y + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + i)));
done:
    free(p), free(weight), free(acc), free(choice), free(order), free(first), free(rows);
    free(row_weight), free(ys);
    return rc;
}

/* An attention task's place in the order the threads take them: by slot, KV head and
 * first key, then row, so that the rows of one sequence (a speculative step's drafted
 * rows, a prefill chunk's) read a block of keys and values one after another on one
 * thread, from its cache, where each row's own pass over the slot's keys and values
 * came from memory (SmolLM2, 9 rows at 1,900 positions: 9.0 -> 8.4 ms in these
 * layers; see docs/performance.md). A task's arithmetic does not depend on the order. */
typedef struct {
    int64_t slot, kv, key, row, task;
} task_key_t;

static int task_order(const void *pa, const void *pb) {
    const task_key_t *a = pa, *b = pb;
    if (a->slot != b->slot) return a->slot < b->slot ? -1 : 1;
    if (a->kv != b->kv) return a->kv < b->kv ? -1 : 1;
    if (a->key != b->key) return a->key < b->key ? -1 : 1;
    return a->row < b->row ? -1 : a->row > b->row;
}

/* The layers, in order, on x [M, hidden] bfloat16 (in place), for the rows' cache slots
 * and positions and bfloat16 RoPE tables cos, sin [M, hd]. Returns 0; -1 when scratch
 * cannot be allocated; -2 when a slot or position is outside the cache (nothing written). */
int decode_layers(const decode_shape_t *S, const decode_layer_t *layers, int64_t count,
                  uint16_t *x, int64_t M, const int64_t *slots, const int64_t *positions,
                  const uint16_t *cos, const uint16_t *sin) {
    int64_t H = S->hidden, hd = S->hd, heads = S->heads, kvh = S->kv_heads;
    int64_t qkv_n = (heads + 2 * kvh) * hd, group = heads / kvh;
    for (int64_t m = 0; m < M; m++)
        if (slots[m] < 0 || slots[m] >= S->slots || positions[m] < 0 || positions[m] >= S->positions)
            return -2;
    size_t per_row = (size_t)(2 * H + qkv_n + heads * hd + 3 * S->inter);
    uint16_t *work = malloc((size_t)M * per_row * 2);
    if (!work) return -1;
    uint16_t *h = work, *qkv = h + M * H, *att = qkv + M * qkv_n, *y = att + M * heads * hd;
    uint16_t *gu = y + M * H, *act = gu + M * 2 * S->inter;
    /* attention tasks: (row, KV head, block of SPLIT keys), a (row, KV head)'s blocks
     * adjacent; each writes group parts of hd + 2 floats. A layer's tasks depend on its
     * window; a full layer's are the most. They run in task_order's order (keyed). */
    int64_t most = 0;
    for (int64_t m = 0; m < M; m++) most += kvh * (positions[m] / SPLIT + 1);
    int64_t *task_row = malloc((size_t)most * 4 * sizeof(int64_t));
    task_key_t *keyed = malloc((size_t)most * sizeof(task_key_t));
    float *parts = malloc((size_t)(most * group * (hd + 2)) * sizeof(float));
    if (!task_row || !keyed || !parts) {
        free(task_row);
        free(keyed);
        free(parts);
        free(work);
        return -1;
    }
    int64_t *task_kv = task_row + most, *task_block = task_kv + most, *task_begin = task_block + most;
    int64_t tasks = 0, tasks_window = -1; /* the window the tasks are for */
    float scale = 1.0f / sqrtf((float)hd);
    int rc = 0;
    for (int64_t l = 0; l < count && !rc; l++) {
        const decode_layer_t *Lr = layers + l;
        for (int64_t m = 0; m < M; m++) rms_norm(x + m * H, Lr->attn_norm, H, S->eps, h + m * H);
        if ((rc = product(Lr->qkv, h, M, qkv, qkv_n))) break;
        for (int64_t m = 0; m < M; m++) {
            uint16_t *row = qkv + m * qkv_n;
            if (Lr->qkv_bias) add_rows(row, Lr->qkv_bias, qkv_n);
            norm_and_rope(S, Lr, row, cos + m * hd, sin + m * hd);
            int64_t at = (slots[m] * kvh * S->positions + positions[m]) * hd;
            for (int64_t j = 0; j < kvh; j++) {
                memcpy(Lr->k_cache + at + j * S->positions * hd, row + (heads + j) * hd, (size_t)hd * 2);
                memcpy(Lr->v_cache + at + j * S->positions * hd, row + (heads + kvh + j) * hd,
                       (size_t)hd * 2);
            }
        }
        if (Lr->window != tasks_window) { /* row m sees keys begin .. positions[m] */
            tasks = 0;
            for (int64_t m = 0; m < M; m++) {
                int64_t begin = Lr->window && positions[m] >= Lr->window ? positions[m] + 1 - Lr->window : 0;
                for (int64_t j = 0; j < kvh; j++)
                    for (int64_t b = 0; b <= (positions[m] - begin) / SPLIT; b++, tasks++) {
                        task_row[tasks] = m;
                        task_kv[tasks] = j;
                        task_block[tasks] = b;
                        task_begin[tasks] = begin;
                        keyed[tasks] = (task_key_t){slots[m], j, begin + b * SPLIT, m, tasks};
                    }
            }
            qsort(keyed, (size_t)tasks, sizeof(task_key_t), task_order);
            tasks_window = Lr->window;
        }
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < tasks; i++) {
            int64_t task = keyed[i].task;
            int64_t m = task_row[task], j = task_kv[task], b = task_block[task];
            int64_t key = task_begin[task] + b * SPLIT, keys = positions[m] + 1 - key;
            int64_t base = (slots[m] * kvh + j) * S->positions * hd + key * hd;
            attend(qkv + m * qkv_n + j * group * hd, group, Lr->k_cache + base,
                   Lr->v_cache + base, keys < SPLIT ? keys : SPLIT, hd, scale,
                   parts + task * group * (hd + 2));
        }
        for (int64_t task = 0; task < tasks; task++) { /* each (row, KV head)'s first block */
            if (task_block[task]) continue;
            int64_t m = task_row[task], j = task_kv[task];
            int64_t blocks = (positions[m] - task_begin[task]) / SPLIT + 1;
            for (int64_t g = 0; g < group; g++) {
                int64_t head = j * group + g;
                combine(parts + (task * group + g) * (hd + 2), blocks, group * (hd + 2), hd,
                        Lr->sinks ? Lr->sinks[head] : -INFINITY, att + m * heads * hd + head * hd);
            }
        }
        if ((rc = product(Lr->o, att, M, y, H))) break;
        if (Lr->o_bias)
            for (int64_t m = 0; m < M; m++) add_rows(y + m * H, Lr->o_bias, H);
        add_rows(x, y, M * H);
        for (int64_t m = 0; m < M; m++) rms_norm(x + m * H, Lr->mlp_norm, H, S->eps, h + m * H);
        if (Lr->router) {
            if ((rc = experts(S, Lr, h, M, y))) break;
        } else {
            if ((rc = product(Lr->gate_up, h, M, gu, 2 * S->inter))) break;
            swiglu(gu, M, S->inter, Lr->gate_up_bias, S->swiglu_limit, S->swiglu_alpha, act);
            if ((rc = product(Lr->down, act, M, y, H))) break;
            if (Lr->down_bias)
                for (int64_t m = 0; m < M; m++) add_rows(y + m * H, Lr->down_bias, H);
        }
        add_rows(x, y, M * H);
    }
    free(task_row);
    free(keyed);
    free(parts);
    free(work);
    return rc;
}
#else /* not built: fused_decode.py calls them only where decode_layers_built() */
int decode_layers_built(void) { return 0; }
int decode_layers(const void *S, const void *layers, int64_t count, uint16_t *x, int64_t M,
                  const int64_t *slots, const int64_t *positions, const uint16_t *cos,
                  const uint16_t *sin) {
    (void)S, (void)layers, (void)count, (void)x, (void)M, (void)slots, (void)positions,
        (void)cos, (void)sin;
    return -1;
}
#endif
