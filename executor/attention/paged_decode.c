/* Paged decode attention for CPUs: one fp32 query token per sequence, keys and values read in place from the
 * paged cache (no gather), each key read once for every query head of its KV head's group.  The cache holds
 * fp32 (paged_decode_f32) or IEEE fp16 (paged_decode_f16, where the CPU has F16C: half the bytes to read, each
 * value widened to fp32 on load, all arithmetic in fp32).
 *
 * Layouts (all contiguous):
 *   q, out        [batch, heads, dim]
 *   k/v cache     [num_blocks, block_size, kv_heads, dim]
 *   tables        [batch, width]  block ids of each sequence, the first ceil(len / block_size) used
 *   lens          [batch]         tokens of each sequence (> 0), the new one included
 *
 * A sequence's keys are walked SPAN tokens at a time (a span: tokens [j SPAN, (j + 1) SPAN), whatever blocks
 * hold them) with an online softmax per query head (FlashAttention's running maximum m, normaliser l and
 * unnormalised accumulator acc; s_t = scale * q . k_t):
 *   m' = max(m, max_t s_t);  l' = l e^(m - m') + sum_t e^(s_t - m');  acc' = acc e^(m - m') + sum_t e^(s_t - m') v_t
 * and out = acc / l after the last span.  The query heads of a KV head's group are taken four at a time (a
 * quad; a group that is not a multiple of four is padded, with copies of its first head where the group is
 * three or more, whose results are dropped): each key is loaded once for the quad's four scores, which land as
 * [token][head] so the softmax runs across the quad's heads in vector lanes, and each value once for the quad's
 * four sums.  Groups of one or two heads take eight or four keys per call instead (no padded products).  All KV heads of
 * a span are done before the next span, so the span's rows are read from memory once.  A group of sequences
 * is walked in lockstep (step j: span j of each sequence that has one), so the leading spans they share (the
 * agents' common system prompt, cached once) are read from memory once per step for all of them, while each
 * sequence still sees its own spans in their order: its result never depends on the rest of the batch or on
 * `threads`.  Every visit prefetches the next visit's span a few rows at a time, spread over its work (blocks
 * are scattered, so the hardware's stream prefetcher starts cold at each).  The batch is split into one group
 * of sequences per OpenMP thread (`threads`; with as many threads as sequences each group is one sequence:
 * parallel, but no reuse).  AVX2 + FMA where the CPU has both (plain loops otherwise); on AVX-512 the scores of
 * groups of three or more heads (four keys a call for a quad, sixteen FMA chains reduced by a transpose-and-add tree)
 * and every value sum run on 16-wide vectors, for head sizes a multiple of 16 (`paged_decode_lanes`; building with
 * -DAGENTSERVE_DECODE_AVX2 keeps the AVX2 walk there, for comparison); that walk prefetches the next span's keys while
 * it scores and its values while it sums them (both at once came to bursts that stalled it by up to 20 % at four
 * sequences with heads of 128).
 * Compiled with -ffast-math (reassociated sums), hence no infinities below; subnormals are flushed only inside
 * the call (the caller's floating-point mode is restored).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __SSE__
#include <xmmintrin.h>
#endif
#ifdef __F16C__
#include <immintrin.h>
#define HAVE_F16 1
#else
#define HAVE_F16 0
#endif

#include "simd_math.h"

#define MAX_HEADS 128
#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_BLOCK 64
#define SPAN 16 /* tokens per visit: one softmax update per query head; a KV head's part stays in L1 beside the next */
#define QUAD 4  /* query heads whose scores and value sums are taken together */

#if defined(__AVX2__) && defined(__FMA__)
#define SIMD8 1
#endif
#if defined(SIMD8) && defined(__AVX512F__) && !defined(AGENTSERVE_DECODE_AVX2)
#define SIMD16 1 /* scores and value sums of groups of three or more heads on 16-wide vectors */
#endif

typedef struct {
    int heads, kv_heads, dim, block_size;
    float scale;
    int row_heads; /* KV heads per cached token (kv_heads, or more when the call attends some of them) */
} Shape;

/* One sequence's tokens of one span: where each token's row (all KV heads) starts in the key and value caches. */
typedef struct {
    const char *k[SPAN], *v[SPAN];
    int n;
} Span;

/* Cache elements: `f16` (a constant at every call: the parallel region picks one specialised walk) says fp16,
 * else fp32.  AT(p, i) is element i from p; LD1 reads one element as a float. */
#define AT(p, i) ((const void *)((const char *)(p) + (int64_t)(i) * (f16 ? 2 : 4)))

INLINE float LD1(const void *p, const int f16) {
#if HAVE_F16
    if (f16) return _cvtsh_ss(*(const uint16_t *)p);
#else
    (void)f16;
#endif
    return *(const float *)p;
}

/* Spans holding sequence b's lens[b] tokens. */
static inline int64_t spans_of(const int64_t *lens, int b) { return (lens[b] + SPAN - 1) / SPAN; }

/* Blocks holding sequence b's lens[b] tokens. */
static inline int64_t blocks_of(const int64_t *lens, int b, int bs) { return (lens[b] + bs - 1) / bs; }

/* Span j of a sequence of `len` tokens whose block ids are `table`; `row` bytes between a block's tokens. */
INLINE void span_at(Span *restrict sp, const char *k_cache, const char *v_cache, const int64_t *restrict table,
                    int64_t len, int64_t j, int bs, int64_t row) {
    const int64_t t0 = j * SPAN;
    sp->n = (int)(len - t0 < SPAN ? len - t0 : SPAN);
    int64_t block = t0 / bs;
    int slot = (int)(t0 % bs);
    for (int i = 0; i < sp->n; i++) {
        const int64_t at = (table[block] * bs + slot) * row;
        sp->k[i] = k_cache + at;
        sp->v[i] = v_cache + at;
        if (++slot == bs) slot = 0, block++;
    }
}

#ifdef SIMD8
/* The sums of 8 vectors, one per lane (lane i = the sum of a[i]'s lanes): a horizontal-add tree. */
INLINE __m256 sum_lanes(const __m256 a[8]) {
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

/* Scores of two keys (ka, kb) for a quad's four query heads: lanes 0-3 key a, lanes 4-7 key b.  Each key chunk is
 * loaded once for the four heads; eight independent FMA chains, then a horizontal-add tree. */
INLINE __m256 dots_quad(const float *const q[QUAD], const void *restrict ka, const void *restrict kb, const int dim,
                        const int f16) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int d = 0; d < dim; d += 8) {
        __m256 x = load8(AT(ka, d), f16), y = load8(AT(kb, d), f16);
        __asm__("" : "+x"(x), "+x"(y)); /* one load of each key chunk for all four heads */
        for (int i = 0; i < QUAD; i++) {
            const __m256 qv = _mm256_loadu_ps(q[i] + d);
            a[i] = _mm256_fmadd_ps(qv, x, a[i]);
            a[QUAD + i] = _mm256_fmadd_ps(qv, y, a[QUAD + i]);
        }
    }
    return sum_lanes(a);
}
#endif

#define KEYS 1
#define VALUES 2

/* Rows [from, to) of the next visit's span (nxt; NULL for none), this KV head's part (`off` bytes into each row) of
 * its keys and/or values (`sides`), asked for ahead of use, one cache line at a time; returns the rows asked for so
 * far.  Spread over a visit's work so the requests never queue up at once. */
INLINE int prefetch_rows(const Span *nxt, int64_t off, const int dim, int from, int to, const int f16,
                         const int sides) {
    if (nxt)
        for (int t = from; t < to; t++)
            for (int d = 0; d < dim; d += (f16 ? 32 : 16)) { /* one 64-byte line */
                if (sides & KEYS) __builtin_prefetch(AT(nxt->k[t] + off, d), 0, 3);
                if (sides & VALUES) __builtin_prefetch(AT(nxt->v[t] + off, d), 0, 3);
            }
    return to > from ? to : from;
}

#ifdef SIMD8
/* Scores of eight keys (k[i] + off) for one query head, lane i key i: eight independent FMA chains. */
INLINE __m256 dots_one8(const float *restrict q, const char *const *k, int64_t off, const int dim, const int f16) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int d = 0; d < dim; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qv, load8(AT(k[i] + off, d), f16), a[i]);
    }
    return sum_lanes(a);
}

/* Scores of four keys for two query heads: lane i key i for q0, lane 4 + i key i for q1; each key chunk loaded
 * once for both heads. */
INLINE __m256 dots_two4(const float *restrict q0, const float *restrict q1, const char *const *k, int64_t off,
                        const int dim, const int f16) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int d = 0; d < dim; d += 8) {
        const __m256 x = _mm256_loadu_ps(q0 + d), y = _mm256_loadu_ps(q1 + d);
        for (int i = 0; i < 4; i++) {
            __m256 kv = load8(AT(k[i] + off, d), f16);
            __asm__("" : "+x"(kv)); /* one load for both heads */
            a[i] = _mm256_fmadd_ps(x, kv, a[i]);
            a[4 + i] = _mm256_fmadd_ps(y, kv, a[4 + i]);
        }
    }
    return sum_lanes(a);
}

/* Scores s[t][r] for a group of one or two heads (`group`), `per` = 8 / group keys a call; a last short call
 * repeats the span's last key and keeps only its real lanes. */
INLINE void scores_narrow(float *restrict s, const float *const *q, int R, int group, const Span *cur, int64_t off,
                          const Span *nxt, const int dim, const int f16) {
    const int n = cur->n, pn = nxt ? nxt->n : 0, per = 8 / group, calls = (n + per - 1) / per;
    int fetched = 0;
    for (int t = 0, call = 0; t < n; t += per) {
        fetched = prefetch_rows(nxt, off, dim, fetched, pn * ++call / calls, f16, KEYS | VALUES);
        const char *k[8];
        for (int i = 0; i < per; i++) k[i] = cur->k[t + i < n ? t + i : n - 1];
        float v[8];
        _mm256_storeu_ps(v, group == 1 ? dots_one8(q[0], k, off, dim, f16) : dots_two4(q[0], q[1], k, off, dim, f16));
        for (int i = 0; i < per && t + i < n; i++)
            for (int r = 0; r < group; r++) s[(t + i) * R + r] = v[r * per + i];
    }
}
#endif

#ifdef SIMD16
/* Lane i of the result is the sum of a[i]'s 16 lanes: pairs of vectors interleaved and added by 32-bit elements,
 * then by 64-bit pairs (each 128-bit lane then holds four partial sums), then across 128-bit lanes. */
INLINE __m512 sum_lanes16(const __m512 a[16]) {
    __m512 s[8], r[4], t[2];
    for (int j = 0; j < 8; j++)
        s[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
    for (int j = 0; j < 4; j++) {
        const __m512d u = _mm512_castps_pd(s[2 * j]), v = _mm512_castps_pd(s[2 * j + 1]);
        r[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, v)), _mm512_castpd_ps(_mm512_unpackhi_pd(u, v)));
    }
    for (int j = 0; j < 2; j++) /* 128-bit lanes 0 + 1 and 2 + 3 of two vectors */
        t[j] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * j], r[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(r[2 * j], r[2 * j + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x88), _mm512_shuffle_f32x4(t[0], t[1], 0xdd));
}

/* Scores of four keys (k[t] + off) for a quad's four query heads: lane 4 t + i is key t's score for head i.  Each
 * key chunk is loaded once for the four heads; sixteen independent FMA chains, then the tree above. */
INLINE __m512 dots_quad16(const float *const q[QUAD], const char *const k[4], int64_t off, const int dim,
                          const int f16) {
    __m512 a[16];
    for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
    for (int d = 0; d < dim; d += 16) {
        __m512 kv[4];
        for (int t = 0; t < 4; t++) {
            kv[t] = load16(AT(k[t] + off, d), f16);
            __asm__("" : "+v"(kv[t])); /* one load of each key chunk for all four heads */
        }
        for (int i = 0; i < QUAD; i++) {
            const __m512 qv = _mm512_loadu_ps(q[i] + d);
            for (int t = 0; t < 4; t++) a[4 * t + i] = _mm512_fmadd_ps(qv, kv[t], a[4 * t + i]);
        }
    }
    return sum_lanes16(a);
}

/* The quads' scores four tokens a call (a last short call repeats the span's last key and keeps its real rows). */
INLINE void scores_quads16(float *restrict s, const float *const *q, int R, const Span *cur, int64_t off,
                           const Span *nxt, const int dim, const int f16) {
    const int n = cur->n, pn = nxt ? nxt->n : 0, calls = (R / QUAD) * ((n + 3) / 4);
    int fetched = 0;
    float v[16] __attribute__((aligned(64)));
    for (int r = 0, call = 0; r < R; r += QUAD)
        for (int t = 0; t < n; t += 4) {
            fetched = prefetch_rows(nxt, off, dim, fetched, pn * ++call / calls, f16, KEYS); /* values in `values` */
            const char *k[4];
            for (int i = 0; i < 4; i++) k[i] = cur->k[t + i < n ? t + i : n - 1];
            _mm512_store_ps(v, dots_quad16(q + r, k, off, dim, f16));
            for (int i = 0; i < 4 && t + i < n; i++) memcpy(s + (t + i) * R + r, v + 4 * i, sizeof(float) * QUAD);
        }
}
#endif

/* Scores s[t][r] (R per token, a multiple of QUAD) of the span's tokens for one KV head's query heads q[r] (its
 * part of each row `off` bytes in; rows from `group` on are padding); the next visit's rows of this head
 * prefetched along the way.  A group of one or two heads leaves its padded rows as they are.  Returns the sides of
 * the next visit's rows left for `values` to prefetch (VALUES where the walk scored on 16-wide vectors, else 0). */
INLINE int scores(float *restrict s, const float *const *q, int R, int group, const Span *cur, int64_t off,
                   const Span *nxt, const int dim, const int f16) {
    const int n = cur->n, pn = nxt ? nxt->n : 0;
    int fetched = 0;
    (void)group; /* the plain loops below score the padded rows too */
#ifdef SIMD8
    if (dim % 8 == 0 && group < 3) {
        scores_narrow(s, q, R, group, cur, off, nxt, dim, f16);
        return 0;
    }
#ifdef SIMD16
    if (dim % 16 == 0) {
        scores_quads16(s, q, R, cur, off, nxt, dim, f16);
        return VALUES;
    }
#endif
    if (dim % 8 == 0) {
        const int calls = (R / QUAD) * ((n + 1) / 2);
        for (int r = 0, call = 0; r < R; r += QUAD)
            for (int t = 0; t < n; t += 2) {
                fetched = prefetch_rows(nxt, off, dim, fetched, pn * ++call / calls, f16, KEYS | VALUES);
                const int u = t + 1 < n ? t + 1 : t; /* an odd last token pairs with itself */
                const __m256 v = dots_quad(q + r, cur->k[t] + off, cur->k[u] + off, dim, f16);
                _mm_storeu_ps(s + t * R + r, _mm256_castps256_ps128(v));
                if (u != t) _mm_storeu_ps(s + u * R + r, _mm256_extractf128_ps(v, 1));
            }
        return 0;
    }
#endif
    for (int t = 0; t < n; t++) {
        fetched = prefetch_rows(nxt, off, dim, fetched, pn * (t + 1) / n, f16, KEYS | VALUES);
        for (int r = 0; r < R; r++) {
            float dot = 0.0f;
            for (int d = 0; d < dim; d++) dot += q[r][d] * LD1(AT(cur->k[t] + off, d), f16);
            s[t * R + r] = dot;
        }
    }
    return 0;
}

#ifdef SIMD8
/* softmax for the quad whose scores are s[t * R .. + 3], maxima m[0..3], normalisers l[0..3], factors c[0..3]:
 * two tokens per vector. */
INLINE void softmax_quad(float *restrict s, int R, int n, float scale, float *restrict m, float *restrict l,
                         float *restrict c) {
    const __m128 old = _mm_loadu_ps(m), k = _mm_set1_ps(scale);
    __m128 mx = old;
    for (int t = 0; t < n; t++) {
        const __m128 x = _mm_mul_ps(_mm_loadu_ps(s + t * R), k);
        _mm_storeu_ps(s + t * R, x);
        mx = _mm_max_ps(mx, x);
    }
    const __m256 top = _mm256_set_m128(mx, mx);
    __m256 sum = _mm256_setzero_ps();
    int t = 0;
    for (; t + 2 <= n; t += 2) {
        float *a = s + t * R, *b = a + R;
        const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_set_m128(_mm_loadu_ps(b), _mm_loadu_ps(a)), top));
        _mm_storeu_ps(a, _mm256_castps256_ps128(e));
        _mm_storeu_ps(b, _mm256_extractf128_ps(e, 1));
        sum = _mm256_add_ps(sum, e);
    }
    /* the odd last token's weights and the rescale factors e^(m - m') in one call */
    const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_set_m128(old, t < n ? _mm_loadu_ps(s + t * R) : mx), top));
    __m128 total = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    if (t < n) {
        _mm_storeu_ps(s + t * R, _mm256_castps256_ps128(e));
        total = _mm_add_ps(total, _mm256_castps256_ps128(e));
    }
    const __m128 factor = _mm256_extractf128_ps(e, 1);
    _mm_storeu_ps(l, _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(l), factor), total));
    _mm_storeu_ps(m, mx);
    _mm_storeu_ps(c, factor);
}
#endif

/* The online-softmax update of one KV head's R query heads over the span's n tokens: s[t][r] holds their scores
 * and becomes their weights e^(scale s - m'); m and l move to the new maxima and normalisers; c gets each head's
 * rescale factor e^(m - m') for its accumulator. */
INLINE void softmax(float *restrict s, int R, int n, float scale, float *restrict m, float *restrict l,
                    float *restrict c) {
#ifdef SIMD8
    for (int r = 0; r < R; r += QUAD) softmax_quad(s + r, R, n, scale, m + r, l + r, c + r);
#else
    for (int r = 0; r < R; r++) {
        float mx = m[r], sum = 0.0f;
        for (int t = 0; t < n; t++) {
            s[t * R + r] *= scale;
            mx = s[t * R + r] > mx ? s[t * R + r] : mx;
        }
        for (int t = 0; t < n; t++) sum += s[t * R + r] = expf(s[t * R + r] - mx);
        c[r] = expf(m[r] - mx);
        l[r] = l[r] * c[r] + sum;
        m[r] = mx;
    }
#endif
}

#ifdef SIMD8
/* acc[i] = c[i] acc[i] + sum_t p[t][i] v_t for `rows` (1..4) query heads (p's rows R apart), two value chunks at a
 * time: each chunk is loaded once for all rows, and 2 x rows independent FMA chains hide the FMA latency. */
INLINE void accumulate(float *restrict acc, const float *restrict c, const float *restrict p, int R, const Span *sp,
                       int64_t off, const int dim, const int rows, const int f16) {
    for (int d = 0; d < dim; d += 16) {
        __m256 a[QUAD], b[QUAD];
        for (int i = 0; i < rows; i++) {
            const __m256 k = _mm256_set1_ps(c[i]);
            a[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + i * dim + d), k);
            b[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + i * dim + d + 8), k);
        }
        for (int t = 0; t < sp->n; t++) {
            const char *vt = sp->v[t] + off;
            __m256 v0 = load8(AT(vt, d), f16), v1 = load8(AT(vt, d + 8), f16);
            __asm__("" : "+x"(v0), "+x"(v1)); /* keep the value chunk in registers for all rows */
            for (int i = 0; i < rows; i++) {
                const __m256 w = _mm256_set1_ps(p[t * R + i]);
                a[i] = _mm256_fmadd_ps(w, v0, a[i]);
                b[i] = _mm256_fmadd_ps(w, v1, b[i]);
            }
        }
        for (int i = 0; i < rows; i++) {
            _mm256_storeu_ps(acc + i * dim + d, a[i]);
            _mm256_storeu_ps(acc + i * dim + d + 8, b[i]);
        }
    }
}
#endif

#ifdef SIMD16
/* As accumulate over dims [d0, d0 + 16 CH) (CH <= 4) on 16-wide vectors: rows x CH independent FMA chains; the values
 * of span `pf` (NULL for none) prefetched along the way. */
INLINE void accumulate16(float *restrict acc, const float *restrict c, const float *restrict p, int R, const Span *sp,
                         int64_t off, const int dim, int d0, const int CH, const int rows, const int f16,
                         const Span *pf) {
    const int pn = pf ? pf->n : 0;
    int fetched = 0;
    __m512 a[QUAD][4];
    for (int i = 0; i < rows; i++) {
        const __m512 k = _mm512_set1_ps(c[i]);
        for (int j = 0; j < CH; j++) a[i][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * dim + d0 + 16 * j), k);
    }
    for (int t = 0; t < sp->n; t++) {
        const char *vt = sp->v[t] + off;
        fetched = prefetch_rows(pf, off, dim, fetched, pn * (t + 1) / sp->n, f16, VALUES);
        __m512 v[4];
        for (int j = 0; j < CH; j++) {
            v[j] = load16(AT(vt, d0 + 16 * j), f16);
            __asm__("" : "+v"(v[j])); /* keep the value chunk in registers for all rows */
        }
        for (int i = 0; i < rows; i++) {
            const __m512 w = _mm512_set1_ps(p[t * R + i]);
            for (int j = 0; j < CH; j++) a[i][j] = _mm512_fmadd_ps(w, v[j], a[i][j]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < CH; j++) _mm512_storeu_ps(acc + i * dim + d0 + 16 * j, a[i][j]);
}

/* accumulate16 over all `dim` dims (a multiple of 16), 64 at a time, prefetching pf's values in the first pass. */
INLINE void accumulate_all16(float *restrict acc, const float *restrict c, const float *restrict p, int R,
                             const Span *sp, int64_t off, const int dim, const int rows, const int f16,
                             const Span *pf) {
    int d = 0;
    for (; d + 64 <= dim; d += 64, pf = NULL) accumulate16(acc, c, p, R, sp, off, dim, d, 4, rows, f16, pf);
    for (; d < dim; d += 16, pf = NULL) accumulate16(acc, c, p, R, sp, off, dim, d, 1, rows, f16, pf);
}
#endif

/* acc[g] = c[g] acc[g] + sum_t p[t][g] v_t for the `group` query heads of one KV head; span pf's values (this head's
 * part; pf NULL for none) prefetched along the way. */
INLINE void values(float *restrict acc, const float *restrict c, const float *restrict p, int R, int group,
                   const Span *sp, int64_t off, const Span *pf, const int dim, const int f16) {
    int g = 0;
    (void)pf; /* only the 16-wide sums prefetch */
#ifdef SIMD16
    if (dim % 16 == 0) {
        for (; g + QUAD <= group; g += QUAD, pf = NULL)
            accumulate_all16(acc + g * dim, c + g, p + g, R, sp, off, dim, QUAD, f16, pf);
        for (; g < group; g++, pf = NULL) accumulate_all16(acc + g * dim, c + g, p + g, R, sp, off, dim, 1, f16, pf);
    }
#elif defined(SIMD8)
    if (dim % 16 == 0) {
        for (; g + QUAD <= group; g += QUAD) accumulate(acc + g * dim, c + g, p + g, R, sp, off, dim, QUAD, f16);
        for (; g < group; g++) accumulate(acc + g * dim, c + g, p + g, R, sp, off, dim, 1, f16);
    }
#endif
    for (; g < group; g++) {
        for (int d = 0; d < dim; d++) acc[g * dim + d] *= c[g];
        for (int t = 0; t < sp->n; t++)
            for (int d = 0; d < dim; d++) acc[g * dim + d] += p[t * R + g] * LD1(AT(sp->v[t] + off, d), f16);
    }
}

/* One visit: a sequence's query heads q [heads, dim] and running m, l, acc against its span `cur`; the next
 * visit's span `nxt` (NULL for none) prefetched along the way. */
INLINE void attend_span(const float *restrict q, const Span *cur, const Span *nxt, float *restrict m,
                        float *restrict l, float *restrict acc, Shape sh, const int dim, const int f16) {
    const int group = sh.heads / sh.kv_heads, R = (group + QUAD - 1) / QUAD * QUAD;
    float s[SPAN * MAX_GROUP];
    for (int t = 0; t < SPAN; t++) /* rows no score path writes (narrow groups): finite, their lanes unused */
        for (int r = group; r < R; r++) s[t * R + r] = 0.0f;
    for (int h = 0; h < sh.kv_heads; h++) {
        const int first = h * group;
        const float *rows[MAX_GROUP];
        float mh[MAX_GROUP], lh[MAX_GROUP], c[MAX_GROUP];
        for (int r = 0; r < R; r++) { /* padding: copies of the first head, on a state of their own */
            rows[r] = q + (int64_t)(first + (r < group ? r : 0)) * dim;
            mh[r] = r < group ? m[first + r] : -FLT_MAX;
            lh[r] = r < group ? l[first + r] : 0.0f;
        }
        const int64_t off = (int64_t)h * dim * (f16 ? 2 : 4);
        const int left = scores(s, rows, R, group, cur, off, nxt, dim, f16);
        softmax(s, R, cur->n, sh.scale, mh, lh, c);
        for (int r = 0; r < group; r++) m[first + r] = mh[r], l[first + r] = lh[r];
        values(acc + (int64_t)first * dim, c, s, R, group, cur, off, left & VALUES ? nxt : NULL, dim, f16);
    }
}

/* The visit after sequence b's span j in lockstep order (span by span, sequences [b0, b1) in order): 1 with b and
 * j moved to it, 0 after the last. */
static int next_visit(const int64_t *lens, int *b, int64_t *j, int b0, int b1, int64_t steps) {
    int nb = *b;
    int64_t nj = *j;
    for (;;) {
        if (++nb == b1) {
            nb = b0;
            if (++nj == steps) return 0;
        }
        if (nj < spans_of(lens, nb)) {
            *b = nb, *j = nj;
            return 1;
        }
    }
}

/* Sequences [b0, b1) in lockstep: step j visits span j of every sequence that has one.  Each sequence's spans
 * are visited in their own order, so its result never depends on the rest of the batch, and the leading spans
 * the sequences share (the agents' system prompt, cached once) are read from memory once per step for all of
 * them.  Every visit prefetches the next visit's span unless it is the same.  The unnormalised accumulators live
 * in `out` until the final division. */
INLINE void attend_group(const float *restrict q, const void *restrict k_cache, const void *restrict v_cache,
                         const int64_t *restrict tables, const int64_t *restrict lens, float *restrict out,
                         float *restrict m, float *restrict l, int b0, int b1, int width, Shape sh, const int dim,
                         const int f16) {
    const int heads = sh.heads, bs = sh.block_size;
    const int64_t row = (int64_t)sh.row_heads * dim * (f16 ? 2 : 4); /* bytes between a block's tokens */
    int64_t steps = 0;
    for (int b = b0; b < b1; b++) steps = spans_of(lens, b) > steps ? spans_of(lens, b) : steps;
    for (int64_t i = (int64_t)b0 * heads; i < (int64_t)b1 * heads; i++) m[i] = -FLT_MAX, l[i] = 0.0f;
    memset(out + (int64_t)b0 * heads * dim, 0, sizeof(float) * (b1 - b0) * heads * dim);
    Span spans[2];
    int b = b1 - 1, cur = 0;
    int64_t j = -1;
    int more = next_visit(lens, &b, &j, b0, b1, steps);
    if (more) span_at(&spans[0], k_cache, v_cache, tables + (int64_t)b * width, lens[b], j, bs, row);
    while (more) {
        const int at = b;
        int nb = b;
        int64_t nj = j;
        more = next_visit(lens, &nb, &nj, b0, b1, steps);
        const Span *nxt = NULL;
        if (more) {
            Span *sp = &spans[1 - cur];
            span_at(sp, k_cache, v_cache, tables + (int64_t)nb * width, lens[nb], nj, bs, row);
            const Span *now = &spans[cur];
            if (sp->n != now->n || sp->k[0] != now->k[0] || sp->k[sp->n - 1] != now->k[now->n - 1]) nxt = sp;
        }
        const int64_t first = (int64_t)at * heads;
        attend_span(q + first * dim, &spans[cur], nxt, m + first, l + first, out + first * dim, sh, dim, f16);
        cur = 1 - cur, b = nb, j = nj;
    }
    for (int64_t i = (int64_t)b0 * heads; i < (int64_t)b1 * heads; i++) {
        const float inv = 1.0f / l[i];
        for (int d = 0; d < dim; d++) out[i * dim + d] *= inv;
    }
}

/* attend_group with dims 64 and 128 as constants (their inner loops unroll into whole vectors). */
INLINE void attend_group_as(const float *restrict q, const void *restrict k_cache, const void *restrict v_cache,
                            const int64_t *restrict tables, const int64_t *restrict lens, float *restrict out,
                            float *restrict m, float *restrict l, int b0, int b1, int width, Shape sh, int dim,
                            const int f16) {
    if (dim == 64)
        attend_group(q, k_cache, v_cache, tables, lens, out, m, l, b0, b1, width, sh, 64, f16);
    else if (dim == 128)
        attend_group(q, k_cache, v_cache, tables, lens, out, m, l, b0, b1, width, sh, 128, f16);
    else
        attend_group(q, k_cache, v_cache, tables, lens, out, m, l, b0, b1, width, sh, dim, f16);
}

/* 1 when the kernel takes this model shape (its stack buffers are sized by the limits above), else 0. */
int paged_decode_supports(int heads, int kv_heads, int dim, int block_size) {
    return heads > 0 && kv_heads > 0 && heads <= MAX_HEADS && heads % kv_heads == 0 &&
           heads / kv_heads <= MAX_GROUP && dim > 0 && dim <= MAX_DIM && block_size > 0 && block_size <= MAX_BLOCK;
}

/* 1 when every sequence has 1 <= len <= width * block_size tokens and its used blocks are in [0, num_blocks). */
static int valid_tables(const int64_t *tables, const int64_t *lens, int batch, int width, int block_size,
                        int64_t num_blocks) {
    for (int b = 0; b < batch; b++) {
        if (lens[b] < 1 || lens[b] > (int64_t)width * block_size) return 0;
        for (int64_t j = 0, used = blocks_of(lens, b, block_size); j < used; j++)
            if (tables[(int64_t)b * width + j] < 0 || tables[(int64_t)b * width + j] >= num_blocks) return 0;
    }
    return 1;
}

/* One group of sequences per thread. */
INLINE int paged_decode(const float *q, const void *k_cache, const void *v_cache, int64_t num_blocks,
                        const int64_t *tables, const int64_t *lens, float *out, int batch, int heads, int kv_heads,
                        int dim, int block_size, int width, float scale, int threads, const int f16) {
    if (!paged_decode_supports(heads, kv_heads, dim, block_size)) return -1;
    if (!valid_tables(tables, lens, batch, width, block_size, num_blocks)) return -2;
    if (batch < 1) return 0;
    const Shape sh = {heads, kv_heads, dim, block_size, scale, kv_heads};
    float *state = malloc(sizeof(float) * 2 * (size_t)batch * heads); /* m, then l, of every head */
    if (state == NULL) return -3;
    const int groups = threads < batch ? (threads > 1 ? threads : 1) : batch; /* one group per thread */
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1)
    for (int g = 0; g < groups; g++) {
#ifdef __SSE__ /* e^(s - m) of far-below-maximum scores is subnormal: flush it here, not in the caller's thread */
        const unsigned csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040); /* FTZ | DAZ */
#endif
        const int b0 = (int)((int64_t)batch * g / groups), b1 = (int)((int64_t)batch * (g + 1) / groups);
        float *m = state, *l = state + (size_t)batch * heads;
        if (f16) /* the element type as a constant inside the region (OpenMP outlines the region once, before
                  * inlining, so the entry points' constants would not reach it) */
            attend_group_as(q, k_cache, v_cache, tables, lens, out, m, l, b0, b1, width, sh, dim, 1);
        else
            attend_group_as(q, k_cache, v_cache, tables, lens, out, m, l, b0, b1, width, sh, dim, 0);
#ifdef __SSE__
        _mm_setcsr(csr);
#endif
    }
    free(state);
    return 0;
}

/* Returns 0; -1 for a shape paged_decode_supports refuses, -2 for lengths or block ids outside the cache
 * (nothing is written then), -3 when its small state buffer cannot be allocated. */
int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, int64_t num_blocks,
                     const int64_t *tables, const int64_t *lens, float *out, int batch, int heads, int kv_heads,
                     int dim, int block_size, int width, float scale, int threads) {
    return paged_decode(q, k_cache, v_cache, num_blocks, tables, lens, out, batch, heads, kv_heads, dim, block_size,
                        width, scale, threads, 0);
}

/* The vector width of this build's scores (groups of three or more query heads per KV head) and value sums, for
 * head sizes a multiple of 16: 16 (AVX-512), 8 (AVX2 + FMA) or 1 (plain loops). */
int paged_decode_lanes(void) {
#if defined(SIMD16)
    return 16;
#elif defined(SIMD8)
    return 8;
#else
    return 1;
#endif
}

/* 1 when this build reads fp16 caches (the CPU has F16C), else 0. */
int paged_decode_has_f16(void) { return HAVE_F16; }

/* As paged_decode_f32 over fp16 caches (IEEE half bit patterns); -4 where the build has no F16C. */
int paged_decode_f16(const float *q, const uint16_t *k_cache, const uint16_t *v_cache, int64_t num_blocks,
                     const int64_t *tables, const int64_t *lens, float *out, int batch, int heads, int kv_heads,
                     int dim, int block_size, int width, float scale, int threads) {
    if (!HAVE_F16) return -4;
    return paged_decode(q, k_cache, v_cache, num_blocks, tables, lens, out, batch, heads, kv_heads, dim, block_size,
                        width, scale, threads, 1);
}

/* One sequence's attention for its KV heads [kv0, kv1) only, over fp16 caches (cache_f16) or fp32 ones: q and out
 * point at the first of their query heads' rows ((kv1 - kv0) * heads / kv_heads rows of dim); k_cache and v_cache
 * are the whole caches.  Each head's numbers are those the whole call computes for it (every head's walk is its
 * own): the fused decode step's helper shares one sequence's attention this way (the step calls it, not Python, so
 * one entry point takes either cache).  Returns as paged_decode_f32 / _f16, and -1 for a head range outside
 * [0, kv_heads). */
int paged_decode_heads(const float *q, const void *k_cache, const void *v_cache, int64_t num_blocks,
                       const int64_t *table, const int64_t *len, float *out, int heads, int kv_heads, int kv0, int kv1,
                       int dim, int block_size, int width, float scale, int cache_f16) {
    if (cache_f16 && !HAVE_F16) return -4;
    if (!paged_decode_supports(heads, kv_heads, dim, block_size) || kv0 < 0 || kv1 > kv_heads || kv0 >= kv1)
        return -1;
    if (!valid_tables(table, len, 1, width, block_size, num_blocks)) return -2;
    const int group = heads / kv_heads;
    const Shape sh = {(kv1 - kv0) * group, kv1 - kv0, dim, block_size, scale, kv_heads};
    float m[MAX_HEADS], l[MAX_HEADS];
    const int64_t skip = (int64_t)kv0 * dim * (cache_f16 ? 2 : 4);
    const char *k = (const char *)k_cache + skip, *v = (const char *)v_cache + skip;
#ifdef __SSE__
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); /* FTZ | DAZ, as paged_decode's threads */
#endif
    if (cache_f16) /* the element type as a constant inside the walk */
        attend_group_as(q, k, v, table, len, out, m, l, 0, 1, width, sh, dim, 1);
    else
        attend_group_as(q, k, v, table, len, out, m, l, 0, 1, width, sh, dim, 0);
#ifdef __SSE__
    _mm_setcsr(csr);
#endif
    return 0;
}
