/* Paged prefill attention in fp32 on AVX2 + FMA CPUs: the rows of one prefill chunk (fp32 queries) attend their
 * sequence's cached keys and values, read from the paged cache (fp16 through F16C, or fp32), all arithmetic in
 * fp32 (the same products PyTorch's flash attention makes, in another order).  The CPUs without bf16 dot products
 * (AVX2-only EPYCs) prefill through it; paged_prefill.c is the bf16 kernel of the CPUs that have them.
 *
 * Layouts (all contiguous):
 *   q, out        [n, heads, dim]            the chunk's n tokens, at positions start .. start + n - 1
 *   k/v cache     [num_blocks, block_size, kv_heads, dim]   the chunk's own keys already written
 *   table         [width]                    the sequence's block ids, the first ceil((start + n) / bs) used
 * Token i attends keys 0 .. start + i (causal, aligned to the last key).
 *
 * Keys are taken KEYS_PER_CHUNK at a time (a chunk's keys and values, for every KV head, stay in L2): each KV
 * head's keys of the chunk are widened to fp32 and packed (the block table is read here only) as tiles of 8
 * keys transposed, [dim][8], so one FMA adds one dim of 8 keys' scores, and its values as [keys][dim].  The
 * query rows (every query head of the KV head's group, for each token) then walk the chunk SPAN rows at a time,
 * block of BLOCK keys by block (a block stays in L1 while every row of the span walks it), with an online
 * softmax (FlashAttention's running maximum m, normaliser l and accumulator o, carried from chunk to chunk):
 *   m' = max(m, max_t s_t);  l' = l e^(m - m') + sum_t e^(s_t - m');  o' = o e^(m - m') + sum_t e^(s_t - m') v_t
 * Scores are taken ROWS rows x 16 keys at a time in registers, the weights go to a small buffer, and the value
 * sums run ROWS rows x 16 dims at a time in registers (12 accumulators: enough independent FMAs to cover their
 * latency); the accumulators are the output rows themselves, scaled by
 * 1 / l at the end.  Work is split over OpenMP threads by (KV head, range of rows) within each chunk, as in
 * paged_prefill.c; a row's result never depends on `threads`, on the other rows or on where its chunk of the
 * prompt began (blocks and chunks of keys start at fixed positions).
 * Compiled with -ffast-math; subnormals are flushed only inside the call.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_prefill.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_FMA8 1
#include <immintrin.h>
#else
#define HAVE_FMA8 0
#endif

#define MAX_DIM 128
#define BLOCK 64 /* keys per step of the walk */
#define ROWS 6   /* query rows whose scores and value sums are taken together */
#define SPAN 36  /* query rows that walk the keys together (a multiple of ROWS) */
#define KEYS_PER_CHUNK 512 /* keys packed at a time (a multiple of BLOCK): every row walks them before the next */

/* 1 when this build has the fp32 kernel (the CPU has AVX2, FMA and F16C), else 0. */
int paged_prefill_fp32_available(void) { return HAVE_FMA8; }

/* 1 where the kernel is the faster fp32 path: built without AVX-512, where PyTorch's flash attention multiplies on
 * the same 8-wide FMAs (with AVX-512 its 16-wide products are not measured against this kernel). */
int paged_prefill_fp32_preferred(void) {
#ifdef __AVX512F__
    return 0;
#else
    return HAVE_FMA8;
#endif
}

/* 1 when the kernel takes this model shape, else 0. */
int paged_prefill_fp32_supports(int heads, int kv_heads, int dim, int block_size) {
    return heads > 0 && kv_heads > 0 && heads <= PREFILL_MAX_HEADS && heads % kv_heads == 0 && dim >= 8 &&
           dim % 8 == 0 && dim <= MAX_DIM && block_size > 0 && block_size <= PREFILL_MAX_BLOCK;
}

#if HAVE_FMA8
/* r[i] holds row i of an 8 x 8 matrix of floats; afterwards r[i] holds column i. */
INLINE void transpose8(__m256 r[8]) {
    __m256 t[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4)
        for (int j = 0; j < 2; j++) {
            r[i + 2 * j] = _mm256_shuffle_ps(t[i + j], t[i + 2 + j], 0x44);
            r[i + 2 * j + 1] = _mm256_shuffle_ps(t[i + j], t[i + 2 + j], 0xEE);
        }
    for (int j = 0; j < 4; j++) {
        t[j] = _mm256_permute2f128_ps(r[j], r[4 + j], 0x20);
        t[4 + j] = _mm256_permute2f128_ps(r[j], r[4 + j], 0x31);
    }
    for (int i = 0; i < 8; i++) r[i] = t[i];
}

/* Keys c0 .. c1 - 1 of head h (c1 - c0 a multiple of BLOCK) into kp as tiles of 8 keys, [dim][8] each, and their
 * values into vp as [keys][dim]; keys from nk on are zero (masked by the walk). */
INLINE void pack(float *restrict kp, float *restrict vp, const void *k_cache, const void *v_cache,
                 const int64_t *table, int64_t c0, int64_t c1, int64_t nk, int bs, int kv_heads, int h, const int dim,
                 const int f16) {
    for (int64_t t0 = c0; t0 < c1; t0 += 8) {
        const char *src[8];
        for (int t = 0; t < 8; t++)
            src[t] = t0 + t < nk ? prefill_token_at(k_cache, table, t0 + t, bs, kv_heads, h, dim, f16) : NULL;
        float *tile = kp + (t0 - c0) * dim;
        for (int d = 0; d < dim; d += 8) {
            __m256 r[8];
            for (int t = 0; t < 8; t++)
                r[t] = src[t] ? load8(src[t] + (int64_t)d * (f16 ? 2 : 4), f16) : _mm256_setzero_ps();
            transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_store_ps(tile + (d + i) * 8, r[i]);
        }
    }
    for (int64_t t = c0; t < c1; t++) {
        float *dst = vp + (t - c0) * dim;
        if (t >= nk) {
            memset(dst, 0, sizeof(float) * dim);
            continue;
        }
        const char *src = prefill_token_at(v_cache, table, t, bs, kv_heads, h, dim, f16);
        for (int d = 0; d < dim; d += 8) _mm256_store_ps(dst + d, load8(src + (int64_t)d * (f16 ? 2 : 4), f16));
    }
}

INLINE float hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

INLINE float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

/* Scores of ROWS query rows (qr: ROWS x dim floats) against the BLOCK keys of the tiles at k: s[r][t]. */
INLINE void scores(float s[ROWS][BLOCK], const float *restrict qr, const float *restrict k, const int dim) {
    for (int j = 0; j < BLOCK / 8; j += 2) {
        const float *k0 = k + j * 8 * dim, *k1 = k0 + 8 * dim;
        __m256 a[ROWS][2];
        for (int r = 0; r < ROWS; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int d = 0; d < dim; d++) {
            const __m256 x = _mm256_load_ps(k0 + d * 8), y = _mm256_load_ps(k1 + d * 8);
            for (int r = 0; r < ROWS; r++) {
                const __m256 b = _mm256_broadcast_ss(qr + r * dim + d);
                a[r][0] = _mm256_fmadd_ps(b, x, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(b, y, a[r][1]);
            }
        }
        for (int r = 0; r < ROWS; r++) {
            _mm256_store_ps(s[r] + j * 8, a[r][0]);
            _mm256_store_ps(s[r] + j * 8 + 8, a[r][1]);
        }
    }
}

/* o[r] = o[r] * c[r] + sum_t p[r][t] v_t for the ROWS rows, 16 dims (two vectors) of every row at a time: ROWS x 2
 * accumulators in registers, each value vector loaded once for every row; a last 8 dims likewise; the BLOCK values
 * are at v ([BLOCK][dim]). */
INLINE void add_values(float *const *o, float p[ROWS][BLOCK], const float *c, const float *restrict v, const int dim) {
    int d = 0;
    for (; d + 16 <= dim; d += 16) {
        __m256 a[ROWS][2];
        for (int r = 0; r < ROWS; r++) {
            a[r][0] = _mm256_mul_ps(_mm256_loadu_ps(o[r] + d), _mm256_set1_ps(c[r]));
            a[r][1] = _mm256_mul_ps(_mm256_loadu_ps(o[r] + d + 8), _mm256_set1_ps(c[r]));
        }
#pragma GCC unroll 4
        for (int t = 0; t < BLOCK; t++) {
            const __m256 x = _mm256_load_ps(v + t * dim + d), y = _mm256_load_ps(v + t * dim + d + 8);
            for (int r = 0; r < ROWS; r++) {
                const __m256 w = _mm256_broadcast_ss(&p[r][t]);
                a[r][0] = _mm256_fmadd_ps(w, x, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(w, y, a[r][1]);
            }
        }
        for (int r = 0; r < ROWS; r++) {
            _mm256_storeu_ps(o[r] + d, a[r][0]);
            _mm256_storeu_ps(o[r] + d + 8, a[r][1]);
        }
    }
    if (d < dim) {
        __m256 a[ROWS];
        for (int r = 0; r < ROWS; r++) a[r] = _mm256_mul_ps(_mm256_loadu_ps(o[r] + d), _mm256_set1_ps(c[r]));
        for (int t = 0; t < BLOCK; t++) {
            const __m256 x = _mm256_load_ps(v + t * dim + d);
            for (int r = 0; r < ROWS; r++) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&p[r][t]), x, a[r]);
        }
        for (int r = 0; r < ROWS; r++) _mm256_storeu_ps(o[r] + d, a[r]);
    }
}

/* Softmax step of one row over a block of BLOCK scores s (row attending keys 0 .. last, the block's first key
 * t0): the running maximum *m and normaliser *l updated, s replaced by the weights e^(s_t - m'); returns the
 * factor e^(m - m') the row's accumulator is to be scaled by. */
INLINE float softmax_step(float *restrict s, float *m, float *l, int64_t last, int64_t t0, int masked, __m256 sv) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 x[BLOCK / 8], keep[BLOCK / 8], top = _mm256_set1_ps(-FLT_MAX);
    for (int j = 0; j < BLOCK / 8; j++) {
        x[j] = _mm256_mul_ps(_mm256_load_ps(s + 8 * j), sv);
        if (masked) { /* keys past last: -FLT_MAX here, weight 0 below */
            keep[j] = _mm256_cmp_ps(lane, _mm256_set1_ps((float)(last - t0 - 8 * j)), _CMP_LE_OQ);
            x[j] = _mm256_blendv_ps(_mm256_set1_ps(-FLT_MAX), x[j], keep[j]);
        }
        top = _mm256_max_ps(top, x[j]);
    }
    const float block_max = hmax8(top), mx = block_max > *m ? block_max : *m;
    const float c = _mm_cvtss_f32(_mm256_castps256_ps128(exp_neg8(_mm256_set1_ps(*m - mx))));
    *m = mx;
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < BLOCK / 8; j++) {
        __m256 p = exp_neg8(_mm256_sub_ps(x[j], _mm256_set1_ps(mx)));
        if (masked) p = _mm256_and_ps(p, keep[j]);
        sum = _mm256_add_ps(sum, p);
        _mm256_store_ps(s + 8 * j, p);
    }
    *l = *l * c + hsum8(sum);
    return c;
}

/* The state of the rows one call walks: accumulator o (the output rows themselves, scaled at the end), running
 * maximum m and normaliser l, and the last key each row attends. */
typedef struct {
    float *o[SPAN];
    float *m, *l;
    int64_t last[SPAN];
} Span;

/* `rows` query rows (a multiple of ROWS, at most SPAN; qr: rows x dim) walk the packed keys kp and values vp of
 * keys c0 .. c1 - 1 (as far as any row attends).  Each block of BLOCK keys is walked by every row before the next
 * (the block stays in L1, the chunk in L2). */
INLINE void walk_span(const float *restrict qr, Span *sp, const float *restrict kp, const float *restrict vp,
                      int64_t c0, int64_t c1, float scale, const int dim, const int rows) {
    float s[ROWS][BLOCK] __attribute__((aligned(32)));
    float c[ROWS];
    const __m256 sv = _mm256_set1_ps(scale);
    const int64_t most = sp->last[rows - 1] + 1 < c1 ? sp->last[rows - 1] + 1 : c1; /* rows in order: last grows */
    for (int64_t t0 = c0; t0 < most; t0 += BLOCK) {
        const float *k = kp + (t0 - c0) * dim, *v = vp + (t0 - c0) * dim;
        for (int g = 0; g < rows; g += ROWS) {
            if (sp->last[g + ROWS - 1] < t0) continue; /* the group attends no key of this block */
            scores(s, qr + g * dim, k, dim);
            const int masked = t0 + BLOCK - 1 > sp->last[g];
            for (int i = 0; i < ROWS; i++)
                c[i] = softmax_step(s[i], sp->m + g + i, sp->l + g + i, sp->last[g + i], t0, masked, sv);
            add_values(sp->o + g, s, c, v, dim);
        }
    }
}

/* Rows r0 .. r1 - 1 of KV head h (rows ordered token by token, the group's query heads within a token), SPAN at a
 * time, over keys c0 .. c1 - 1.  The rows' accumulators are their output rows (out), their maxima and normalisers
 * m[row], l[row], walked on copies; the last span repeats its last row to fill a multiple of ROWS (the copies'
 * state goes to scratch and is dropped). */
INLINE void attend_rows(const float *q, float *out, float *m, float *l, const float *kp, const float *vp,
                        int64_t start, int heads, int group, int h, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                        float scale, const int dim) {
    float qr[SPAN * MAX_DIM] __attribute__((aligned(32)));
    float scratch[ROWS][MAX_DIM], span_m[SPAN], span_l[SPAN];
    for (int64_t r = r0; r < r1; r += SPAN) {
        const int real = r1 - r < SPAN ? (int)(r1 - r) : SPAN, rows = (real + ROWS - 1) / ROWS * ROWS;
        if (start + (r + real - 1) / group < c0) continue; /* past every key here */
        Span sp = {.m = span_m, .l = span_l};
        for (int i = 0; i < rows; i++) {
            const int64_t row = r + (i < real ? i : real - 1), token = row / group;
            const int64_t at = (token * heads + h * group + row % group) * dim;
            memcpy(qr + i * dim, q + at, sizeof(float) * dim);
            sp.last[i] = start + token, span_m[i] = m[row], span_l[i] = l[row];
            sp.o[i] = i < real ? out + at : memcpy(scratch[i % ROWS], out + at, sizeof(float) * dim);
        }
        walk_span(qr, &sp, kp, vp, c0, c1, scale, dim, rows);
        memcpy(m + r, span_m, sizeof(float) * real), memcpy(l + r, span_l, sizeof(float) * real);
    }
}

INLINE int paged_prefill(const float *q, const void *k_cache, const void *v_cache, int64_t num_blocks,
                         const int64_t *table, int width, int64_t start, int n, float *out, int heads, int kv_heads,
                         int dim, int block_size, float scale, int threads, const int f16) {
    if (!paged_prefill_fp32_supports(heads, kv_heads, dim, block_size)) return -1;
    const int checked = prefill_check_chunk(table, width, num_blocks, start, n, block_size);
    if (checked != 0) return checked;
    const int64_t nk = start + n;
    const int group = heads / kv_heads;
    const int64_t rows = (int64_t)n * group, padded = (nk + BLOCK - 1) / BLOCK * BLOCK;
    const int64_t per_head = (int64_t)KEYS_PER_CHUNK * dim; /* floats per head, keys and values each */
    /* the packed keys and values of one chunk of keys (KEYS_PER_CHUNK keys of every KV head, not the context) */
    float *kp = prefill_scratch(sizeof(float) * 2 * (size_t)per_head * kv_heads);
    float *ml = malloc(sizeof(float) * 2 * rows * kv_heads);
    if (kp == NULL || ml == NULL) {
        prefill_scratch_done(kp), free(ml);
        return -3;
    }
    float *vp = kp + per_head * kv_heads;
    for (int64_t i = 0; i < rows * kv_heads; i++) ml[i] = -FLT_MAX, ml[rows * kv_heads + i] = 0.0f;
    memset(out, 0, sizeof(float) * n * heads * dim);
    const int64_t blocks = (rows + ROWS - 1) / ROWS;
    const int64_t parts = prefill_parts(blocks, threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const unsigned csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040); /* FTZ | DAZ, this thread only */
        for (int64_t c0 = 0; c0 < padded; c0 += KEYS_PER_CHUNK) {
            const int64_t c1 = c0 + KEYS_PER_CHUNK < padded ? c0 + KEYS_PER_CHUNK : padded;
#pragma omp for schedule(static)
            for (int h = 0; h < kv_heads; h++)
                pack(kp + h * per_head, vp + h * per_head, k_cache, v_cache, table, c0, c1, nk, block_size, kv_heads, h,
                     dim, f16);
#pragma omp for schedule(dynamic, 1) collapse(2)
            for (int h = 0; h < kv_heads; h++)
                for (int64_t part = 0; part < parts; part++) {
                    const int64_t r0 = blocks * part / parts * ROWS, r1 = blocks * (part + 1) / parts * ROWS;
                    const int64_t end = r1 < rows ? r1 : rows;
                    const float *hk = kp + h * per_head, *hv = vp + h * per_head;
                    float *m = ml + h * rows, *l = ml + (kv_heads + h) * rows;
                    if (dim == 64) /* the common sizes as constants: their loops unroll into whole vectors */
                        attend_rows(q, out, m, l, hk, hv, start, heads, group, h, r0, end, c0, c1, scale, 64);
                    else if (dim == 128)
                        attend_rows(q, out, m, l, hk, hv, start, heads, group, h, r0, end, c0, c1, scale, 128);
                    else
                        attend_rows(q, out, m, l, hk, hv, start, heads, group, h, r0, end, c0, c1, scale, dim);
                }
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < (int64_t)n * heads; i++) { /* out row i: token i / heads, head i % heads */
            const int h = (int)(i % heads) / group;
            const float inv = 1.0f / ml[(kv_heads + h) * rows + (i / heads) * group + (i % heads) % group];
            for (int d = 0; d < dim; d++) out[i * dim + d] *= inv;
        }
        _mm_setcsr(csr);
    }
    prefill_scratch_done(kp), free(ml);
    return 0;
}
#else
#define paged_prefill(...) (-4) /* no AVX2 + FMA + F16C in this build */
#endif

PREFILL_ENTRY_POINTS(paged_prefill_fp32, paged_prefill)
