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
 * A sequence's keys are walked block by block with an online softmax per query head (FlashAttention's
 * running maximum m, normaliser l and unnormalised accumulator acc; s_t = scale * q . k_t):
 *   m' = max(m, max_t s_t);  l' = l e^(m - m') + sum_t e^(s_t - m');  acc' = acc e^(m - m') + sum_t e^(s_t - m') v_t
 * and out = acc / l after the last block.  All KV heads of a block are done before the next block, so the
 * block's rows are read from memory once.  A group of sequences is walked in lockstep (step j: block j of
 * each sequence that has one), so the leading blocks they share (the agents' common system prompt, cached
 * once) are read from memory once per step for all of them, while each sequence still sees its own blocks in
 * their order: its result never depends on the rest of the batch or on `threads`.  Every visit prefetches the
 * next visit's block a few rows at a time, spread over its work (the blocks are scattered, so the hardware's
 * stream prefetcher starts cold at each).  The batch is split into one group of sequences per OpenMP thread
 * (`threads`; with as many threads as sequences each group is one sequence: parallel, but no reuse).  Scores
 * (two query heads per key load) and value sums (four per value load) use AVX2 + FMA where the CPU has both
 * (plain loops otherwise).
 * Compiled with -ffast-math (vectorised exp, reassociated sums), hence no infinities below; subnormals are
 * flushed only inside the call (the caller's floating-point mode is restored).
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

#define MAX_HEADS 128
#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_BLOCK 64

typedef struct {
    int heads, kv_heads, dim, block_size;
    float scale;
} Shape;

#define INLINE static inline __attribute__((always_inline))

/* Cache elements: `f16` (a constant at every call: the entry points pick one specialised walk) says fp16, else
 * fp32.  AT(p, i) is element i from p; LD1 reads one element as a float. */
#define AT(p, i) ((const void *)((const char *)(p) + (int64_t)(i) * (f16 ? 2 : 4)))

INLINE float LD1(const void *p, const int f16) {
#if HAVE_F16
    if (f16) return _cvtsh_ss(*(const uint16_t *)p);
#else
    (void)f16;
#endif
    return *(const float *)p;
}

/* Blocks holding sequence b's lens[b] tokens. */
static inline int64_t blocks_of(const int64_t *lens, int b, int bs) { return (lens[b] + bs - 1) / bs; }

#if defined(__AVX2__) && defined(__FMA__)
#define SIMD8 1
#include <immintrin.h>

/* Eight consecutive cache elements as floats. */
INLINE __m256 LD8(const void *p, const int f16) {
#if HAVE_F16
    if (f16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#endif
    return _mm256_loadu_ps((const float *)p);
}

/* The sums of 8 vectors, one per lane (lane i = the sum of a[i]'s lanes): a horizontal-add tree. */
INLINE __m256 sum_lanes(const __m256 a[8]) {
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

/* Scores of 8 consecutive tokens: q . k_t for t = 0..7, as one vector.  8 independent FMA chains, then a
 * horizontal-add tree that sums each chain into its lane. */
INLINE __m256 dots8(const float *restrict q, const void *restrict k, int64_t row, const int dim, const int f16) {
    __m256 a[8];
    for (int t = 0; t < 8; t++) a[t] = _mm256_setzero_ps();
    for (int d = 0; d < dim; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int t = 0; t < 8; t++) a[t] = _mm256_fmadd_ps(qv, LD8(AT(k, t * row + d), f16), a[t]);
    }
    return sum_lanes(a);
}

/* Scores of 4 consecutive tokens for 2 query heads: lanes 0-3 q0 . k_t, lanes 4-7 q1 . k_t.  Each key chunk
 * is loaded once for both heads. */
INLINE __m256 dots4x2(const float *restrict q0, const float *restrict q1, const void *restrict k, int64_t row,
                      const int dim, const int f16) {
    __m256 a[8];
    for (int t = 0; t < 8; t++) a[t] = _mm256_setzero_ps();
    for (int d = 0; d < dim; d += 8) {
        const __m256 x = _mm256_loadu_ps(q0 + d), y = _mm256_loadu_ps(q1 + d);
        for (int t = 0; t < 4; t++) {
            __m256 kv = LD8(AT(k, t * row + d), f16);
            __asm__("" : "+x"(kv)); /* one load for both heads */
            a[t] = _mm256_fmadd_ps(x, kv, a[t]);
            a[4 + t] = _mm256_fmadd_ps(y, kv, a[4 + t]);
        }
    }
    return sum_lanes(a);
}

/* acc[i] += sum_t p[i][t] v_t for `rows` (1..4) query heads, two value chunks at a time: each chunk is
 * loaded once for all rows, and 2 x rows independent FMA chains hide the FMA latency. */
INLINE void accumulate(float *restrict acc, const float *restrict p, const void *restrict vb, int n, int64_t row,
                       const int dim, const int rows, const int f16) {
    for (int d = 0; d < dim; d += 16) {
        __m256 a[4], b[4];
        for (int i = 0; i < rows; i++) {
            a[i] = _mm256_loadu_ps(acc + i * dim + d);
            b[i] = _mm256_loadu_ps(acc + i * dim + d + 8);
        }
        for (int t = 0; t < n; t++) {
            __m256 v0 = LD8(AT(vb, t * row + d), f16), v1 = LD8(AT(vb, t * row + d + 8), f16);
            __asm__("" : "+x"(v0), "+x"(v1)); /* keep the value chunk in registers for all rows */
            for (int i = 0; i < rows; i++) {
                const __m256 w = _mm256_set1_ps(p[i * MAX_BLOCK + t]);
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

INLINE void scores(const float *restrict q, const void *restrict kb, int n, int64_t row, const int dim,
                   float *restrict s, const int f16) {
    int t = 0;
#ifdef SIMD8
    if (dim % 8 == 0)
        for (; t + 8 <= n; t += 8) _mm256_storeu_ps(s + t, dots8(q, AT(kb, t * row), row, dim, f16));
#endif
    for (; t < n; t++) {
        float dot = 0.0f;
        for (int d = 0; d < dim; d++) dot += q[d] * LD1(AT(kb, t * row + d), f16);
        s[t] = dot;
    }
}

INLINE void values(float *restrict acc, const float *restrict p, const void *restrict vb, int n, int64_t row,
                   int group, const int dim, const int f16) {
    int g = 0;
#ifdef SIMD8
    if (dim % 16 == 0) {
        for (; g + 4 <= group; g += 4) accumulate(acc + g * dim, p + g * MAX_BLOCK, vb, n, row, dim, 4, f16);
        for (; g < group; g++) accumulate(acc + g * dim, p + g * MAX_BLOCK, vb, n, row, dim, 1, f16);
    }
#endif
    for (; g < group; g++)
        for (int t = 0; t < n; t++)
            for (int d = 0; d < dim; d++) acc[g * dim + d] += p[g * MAX_BLOCK + t] * LD1(AT(vb, t * row + d), f16);
}

/* Rows [from, to) of this head's keys and values in the next block (pk, pv; NULL for none), asked for ahead
 * of use, one cache line at a time; returns the rows asked for so far.  Spread over the block's work so the
 * requests never queue up at once. */
INLINE int prefetch_rows(const void *pk, const void *pv, int64_t row, const int dim, int from, int to,
                         const int f16) {
    if (pk)
        for (int t = from; t < to; t++)
            for (int d = 0; d < dim; d += (f16 ? 32 : 16)) { /* one 64-byte line */
                __builtin_prefetch(AT(pk, t * row + d), 0, 3);
                __builtin_prefetch(AT(pv, t * row + d), 0, 3);
            }
    return to > from ? to : from;
}

/* One block of one KV head: n tokens whose keys/values start at kb/vb, `row` floats apart; the group's
 * query heads q[g], running m[g], l[g], acc[g] updated in place; the next block's pn rows of this head
 * (pk, pv) prefetched along the way. */
INLINE void attend_block(const float *restrict q, const void *restrict kb, const void *restrict vb, int n,
                         int64_t row, int group, const int dim, float scale, float *restrict m, float *restrict l,
                         float *restrict acc, const void *pk, const void *pv, int pn, const int f16) {
    float p[MAX_GROUP * MAX_BLOCK];
    int paired = 0, fetched = 0; /* query heads whose scores are in p; next-block rows asked for */
#ifdef SIMD8
    if (dim % 8 == 0)
        for (; paired + 2 <= group; paired += 2) {
            const float *q0 = q + paired * dim, *q1 = q0 + dim;
            float *s0 = p + paired * MAX_BLOCK, *s1 = s0 + MAX_BLOCK;
            int t = 0;
            const int calls = (group / 2) * (n / 4);
            for (; t + 4 <= n; t += 4) {
                const int call = (paired / 2) * (n / 4) + t / 4;
                fetched = prefetch_rows(pk, pv, row, dim, fetched, pn * (call + 1) / calls, f16);
                const __m256 v = dots4x2(q0, q1, AT(kb, t * row), row, dim, f16);
                _mm_storeu_ps(s0 + t, _mm256_castps256_ps128(v));
                _mm_storeu_ps(s1 + t, _mm256_extractf128_ps(v, 1));
            }
            scores(q0, AT(kb, t * row), n - t, row, dim, s0 + t, f16); /* the last n % 4 tokens */
            scores(q1, AT(kb, t * row), n - t, row, dim, s1 + t, f16);
        }
#endif
    for (int g = 0; g < group; g++) {
        fetched = prefetch_rows(pk, pv, row, dim, fetched, pn * (g + 1) / group, f16);
        float *restrict s = p + g * MAX_BLOCK;
        if (g >= paired) scores(q + g * dim, kb, n, row, dim, s, f16);
        float mx = m[g];
        for (int t = 0; t < n; t++) {
            s[t] *= scale;
            mx = s[t] > mx ? s[t] : mx;
        }
        float sum = 0.0f;
        for (int t = 0; t < n; t++) {
            s[t] = expf(s[t] - mx);
            sum += s[t];
        }
        if (mx > m[g]) { /* a new maximum rescales the running sums (to 0 on the first block, m = -FLT_MAX) */
            const float c = expf(m[g] - mx);
            l[g] *= c;
            for (int d = 0; d < dim; d++) acc[g * dim + d] *= c;
        }
        l[g] += sum;
        m[g] = mx;
    }
    values(acc, p, vb, n, row, group, dim, f16);
}

/* Block number j of one sequence (cache block `id`) into its running state (m, l, acc for each of its heads); `next`
 * is the block to ask for ahead of use (-1 for none). */
INLINE void attend_one(const float *restrict q, const void *restrict k_cache, const void *restrict v_cache,
                       int64_t id, int64_t j, int64_t len, float *restrict m, float *restrict l, float *restrict acc,
                       Shape sh, const int dim, int64_t next, const int f16) {
    const int kv_heads = sh.kv_heads, bs = sh.block_size, group = sh.heads / kv_heads;
    const int64_t row = (int64_t)kv_heads * dim; /* floats between consecutive tokens of one block */
    const int n = (int)(len - j * bs < bs ? len - j * bs : bs);
    const int64_t base = id * bs * row, nbase = next < 0 ? 0 : next * bs * row;
    for (int h = 0; h < kv_heads; h++) {
        const int first = h * group;
        attend_block(q + first * dim, AT(k_cache, base + h * dim), AT(v_cache, base + h * dim), n, row, group, dim,
                     sh.scale, m + first, l + first, acc + first * dim, next < 0 ? NULL : AT(k_cache, nbase + h * dim),
                     next < 0 ? NULL : AT(v_cache, nbase + h * dim), bs, f16);
    }
}

/* The cache block of the visit after sequence b's block `step` in attend_group's order; -1 after the last. */
static int64_t next_block(const int64_t *tables, const int64_t *lens, int b, int64_t step, int b0, int b1, int width,
                          int bs, int64_t steps) {
    for (;;) {
        if (++b == b1) {
            b = b0;
            if (++step == steps) return -1;
        }
        if (step < blocks_of(lens, b, bs)) return tables[(int64_t)b * width + step];
    }
}

/* Sequences [b0, b1) in lockstep: step j visits block j of every sequence that has one.  Each sequence's
 * blocks are visited in their own order, so its result never depends on the rest of the batch, and the
 * leading blocks the sequences share (the agents' system prompt, cached once) are read from memory once
 * per step for all of them.  Every visit prefetches the next visit's block.  The unnormalised accumulators
 * live in `out` until the final division. */
INLINE void attend_group(const float *restrict q, const void *restrict k_cache, const void *restrict v_cache,
                         const int64_t *restrict tables, const int64_t *restrict lens, float *restrict out,
                         float *restrict m, float *restrict l, int b0, int b1, int width, Shape sh, const int dim,
                         const int f16) {
    const int heads = sh.heads, bs = sh.block_size;
    int64_t steps = 0;
    for (int b = b0; b < b1; b++) steps = blocks_of(lens, b, bs) > steps ? blocks_of(lens, b, bs) : steps;
    for (int64_t i = (int64_t)b0 * heads; i < (int64_t)b1 * heads; i++) m[i] = -FLT_MAX, l[i] = 0.0f;
    memset(out + (int64_t)b0 * heads * dim, 0, sizeof(float) * (b1 - b0) * heads * dim);
    for (int64_t j = 0; j < steps; j++)
        for (int b = b0; b < b1; b++) {
            if (j >= blocks_of(lens, b, bs)) continue;
            const int64_t at = (int64_t)b * heads, id = tables[(int64_t)b * width + j];
            const int64_t next = next_block(tables, lens, b, j, b0, b1, width, bs, steps);
            attend_one(q + at * dim, k_cache, v_cache, id, j, lens[b], m + at, l + at, out + at * dim, sh, dim,
                       next == id ? -1 : next, f16);
        }
    for (int64_t i = (int64_t)b0 * heads; i < (int64_t)b1 * heads; i++) {
        const float inv = 1.0f / l[i];
        for (int d = 0; d < dim; d++) out[i * dim + d] *= inv;
    }
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

/* One group of sequences per thread, with dims 64 and 128 as constants (their inner loops unroll into whole
 * vectors) and the cache's element type `f16` as a constant (one specialised walk each). */
INLINE int paged_decode(const float *q, const void *k_cache, const void *v_cache, int64_t num_blocks,
                        const int64_t *tables, const int64_t *lens, float *out, int batch, int heads, int kv_heads,
                        int dim, int block_size, int width, float scale, int threads, const int f16) {
    if (!paged_decode_supports(heads, kv_heads, dim, block_size)) return -1;
    if (!valid_tables(tables, lens, batch, width, block_size, num_blocks)) return -2;
    if (batch < 1) return 0;
    const Shape sh = {heads, kv_heads, dim, block_size, scale};
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
        if (dim == 64)
            attend_group(q, k_cache, v_cache, tables, lens, out, m, l, b0, b1, width, sh, 64, f16);
        else if (dim == 128)
            attend_group(q, k_cache, v_cache, tables, lens, out, m, l, b0, b1, width, sh, 128, f16);
        else
            attend_group(q, k_cache, v_cache, tables, lens, out, m, l, b0, b1, width, sh, dim, f16);
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
