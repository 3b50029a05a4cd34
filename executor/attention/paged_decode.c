/* Paged decode attention for CPUs, fp32: one query token per sequence, keys and values read in place
 * from the paged cache (no gather), each key read once for every query head of its KV head's group.
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
 * block's rows are read from memory once.  The leading blocks every sequence of the batch shares (the
 * agents' common system prompt, cached once) are walked first, block by block with the sequences inner, so
 * each is read from memory once for the whole batch; then each sequence walks its own blocks.  The batch is
 * split into one group of sequences per OpenMP thread (`threads`), each group finding its own shared span
 * (with as many threads as sequences each group is one sequence: parallel, but no reuse).  Scores and value sums use AVX2 + FMA where the CPU has both (plain loops otherwise).
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

#define MAX_HEADS 128
#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_BLOCK 64

typedef struct {
    int heads, kv_heads, dim, block_size;
    float scale;
} Shape;

#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX2__) && defined(__FMA__)
#define SIMD8 1
#include <immintrin.h>

/* Scores of 8 consecutive tokens: q . k_t for t = 0..7, as one vector.  8 independent FMA chains, then a
 * horizontal-add tree that sums each chain into its lane. */
INLINE __m256 dots8(const float *restrict q, const float *restrict k, int64_t row, const int dim) {
    __m256 a[8];
    for (int t = 0; t < 8; t++) a[t] = _mm256_setzero_ps();
    for (int d = 0; d < dim; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int t = 0; t < 8; t++) a[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + t * row + d), a[t]);
    }
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

/* acc[i] += sum_t p[i][t] v_t for `rows` (1..4) query heads, two value chunks at a time: each chunk is
 * loaded once for all rows, and 2 x rows independent FMA chains hide the FMA latency. */
INLINE void accumulate(float *restrict acc, const float *restrict p, const float *restrict vb, int n, int64_t row,
                       const int dim, const int rows) {
    for (int d = 0; d < dim; d += 16) {
        __m256 a[4], b[4];
        for (int i = 0; i < rows; i++) {
            a[i] = _mm256_loadu_ps(acc + i * dim + d);
            b[i] = _mm256_loadu_ps(acc + i * dim + d + 8);
        }
        for (int t = 0; t < n; t++) {
            const __m256 v0 = _mm256_loadu_ps(vb + t * row + d), v1 = _mm256_loadu_ps(vb + t * row + d + 8);
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

INLINE void scores(const float *restrict q, const float *restrict kb, int n, int64_t row, const int dim,
                   float *restrict s) {
    int t = 0;
#ifdef SIMD8
    if (dim % 8 == 0)
        for (; t + 8 <= n; t += 8) _mm256_storeu_ps(s + t, dots8(q, kb + t * row, row, dim));
#endif
    for (; t < n; t++) {
        float dot = 0.0f;
        for (int d = 0; d < dim; d++) dot += q[d] * kb[t * row + d];
        s[t] = dot;
    }
}

INLINE void values(float *restrict acc, const float *restrict p, const float *restrict vb, int n, int64_t row,
                   int group, const int dim) {
    int g = 0;
#ifdef SIMD8
    if (dim % 16 == 0) {
        for (; g + 4 <= group; g += 4) accumulate(acc + g * dim, p + g * MAX_BLOCK, vb, n, row, dim, 4);
        for (; g < group; g++) accumulate(acc + g * dim, p + g * MAX_BLOCK, vb, n, row, dim, 1);
    }
#endif
    for (; g < group; g++)
        for (int t = 0; t < n; t++)
            for (int d = 0; d < dim; d++) acc[g * dim + d] += p[g * MAX_BLOCK + t] * vb[t * row + d];
}

/* One block of one KV head: n tokens whose keys/values start at kb/vb, `row` floats apart; the group's
 * query heads q[g], running m[g], l[g], acc[g] updated in place. */
INLINE void attend_block(const float *restrict q, const float *restrict kb, const float *restrict vb, int n,
                         int64_t row, int group, const int dim, float scale, float *restrict m, float *restrict l,
                         float *restrict acc) {
    float p[MAX_GROUP * MAX_BLOCK];
    for (int g = 0; g < group; g++) {
        float *restrict s = p + g * MAX_BLOCK;
        scores(q + g * dim, kb, n, row, dim, s);
        float mx = m[g];
        for (int t = 0; t < n; t++) {
            s[t] *= scale;
            mx = s[t] > mx ? s[t] : mx;
        }
        const float c = expf(m[g] - mx); /* 1 when the maximum held; 0 on the first block (m = -FLT_MAX) */
        float sum = 0.0f;
        for (int t = 0; t < n; t++) {
            s[t] = expf(s[t] - mx);
            sum += s[t];
        }
        l[g] = l[g] * c + sum;
        m[g] = mx;
        for (int d = 0; d < dim; d++) acc[g * dim + d] *= c;
    }
    values(acc, p, vb, n, row, group, dim);
}

/* Blocks [j0, j1) of one sequence into its running state (m, l, acc for each of its heads). */
INLINE void attend_blocks(const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,
                          const int64_t *restrict table, int64_t j0, int64_t j1, int64_t len, float *restrict m,
                          float *restrict l, float *restrict acc, Shape sh, const int dim) {
    const int kv_heads = sh.kv_heads, bs = sh.block_size, group = sh.heads / kv_heads;
    const int64_t row = (int64_t)kv_heads * dim; /* floats between consecutive tokens of one block */
    for (int64_t j = j0; j < j1; j++) {
        const int n = (int)(len - j * bs < bs ? len - j * bs : bs);
        const int64_t base = table[j] * bs * row;
        for (int h = 0; h < kv_heads; h++) {
            const int first = h * group;
            attend_block(q + first * dim, k_cache + base + h * dim, v_cache + base + h * dim, n, row, group, dim,
                         sh.scale, m + first, l + first, acc + first * dim);
        }
    }
}

/* Leading blocks identical in the tables of a group's sequences and complete in each (the agents' shared
 * system prompt, cached once). */
static int64_t shared_blocks(const int64_t *tables, const int64_t *lens, int batch, int width, int block_size) {
    int64_t shortest = lens[0];
    for (int b = 1; b < batch; b++) shortest = lens[b] < shortest ? lens[b] : shortest;
    const int64_t limit = shortest / block_size;
    for (int64_t j = 0; j < limit; j++)
        for (int b = 1; b < batch; b++)
            if (tables[(int64_t)b * width + j] != tables[j]) return j;
    return batch > 1 ? limit : 0;
}

/* Sequences [b0, b1): the blocks they all share first, block by block with the sequences inner (a shared
 * block is read from memory once for all of them), then each sequence's own blocks; the unnormalised
 * accumulators live in `out` until the final division. */
INLINE void attend_group(const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,
                         const int64_t *restrict tables, const int64_t *restrict lens, float *restrict out,
                         float *restrict m, float *restrict l, int b0, int b1, int width, Shape sh, const int dim) {
    const int heads = sh.heads;
    const int64_t shared = shared_blocks(tables + (int64_t)b0 * width, lens + b0, b1 - b0, width, sh.block_size);
    for (int64_t i = (int64_t)b0 * heads; i < (int64_t)b1 * heads; i++) m[i] = -FLT_MAX, l[i] = 0.0f;
    memset(out + (int64_t)b0 * heads * dim, 0, sizeof(float) * (b1 - b0) * heads * dim);
    for (int64_t j = 0; j < shared; j++)
        for (int b = b0; b < b1; b++) {
            const int64_t at = (int64_t)b * heads;
            attend_blocks(q + at * dim, k_cache, v_cache, tables + (int64_t)b * width, j, j + 1, lens[b], m + at,
                          l + at, out + at * dim, sh, dim);
        }
    for (int b = b0; b < b1; b++) {
        const int64_t at = (int64_t)b * heads, blocks = (lens[b] + sh.block_size - 1) / sh.block_size;
        attend_blocks(q + at * dim, k_cache, v_cache, tables + (int64_t)b * width, shared, blocks, lens[b], m + at,
                      l + at, out + at * dim, sh, dim);
        for (int h = 0; h < heads; h++) {
            const float inv = 1.0f / l[at + h];
            for (int d = 0; d < dim; d++) out[(at + h) * dim + d] *= inv;
        }
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
        for (int64_t j = 0, used = (lens[b] + block_size - 1) / block_size; j < used; j++)
            if (tables[(int64_t)b * width + j] < 0 || tables[(int64_t)b * width + j] >= num_blocks) return 0;
    }
    return 1;
}

/* Returns 0; -1 for a shape paged_decode_supports refuses, -2 for lengths or block ids outside the cache
 * (nothing is written then), -3 when its small state buffer cannot be allocated. */
int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, int64_t num_blocks,
                     const int64_t *tables, const int64_t *lens, float *out, int batch, int heads, int kv_heads,
                     int dim, int block_size, int width, float scale, int threads) {
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
        if (dim == 64) /* constant dims: the inner loops unroll into whole vectors */
            attend_group(q, k_cache, v_cache, tables, lens, out, m, l, b0, b1, width, sh, 64);
        else if (dim == 128)
            attend_group(q, k_cache, v_cache, tables, lens, out, m, l, b0, b1, width, sh, 128);
        else
            attend_group(q, k_cache, v_cache, tables, lens, out, m, l, b0, b1, width, sh, dim);
#ifdef __SSE__
        _mm_setcsr(csr);
#endif
    }
    free(state);
    return 0;
}
