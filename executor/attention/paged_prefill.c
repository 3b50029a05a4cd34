/* Paged prefill attention on AVX512-BF16 CPUs: the rows of one prefill chunk (fp32 queries) attend their
 * sequence's cached keys and values, read from the paged cache (fp16 or fp32) and multiplied on the CPU's
 * bf16 dot-product units with fp32 accumulation (VDPBF16PS: 32 multiply-adds per instruction, twice the fp32
 * FMA rate).  For the rows a hybrid matrix already multiplies in bf16 (prefill chunks), the same rounding.
 *
 * Layouts (all contiguous):
 *   q, out        [n, heads, dim]            the chunk's n tokens, at positions start .. start + n - 1
 *   k/v cache     [num_blocks, block_size, kv_heads, dim]   the chunk's own keys already written
 *   table         [width]                    the sequence's block ids, the first ceil((start + n) / bs) used
 * Token i attends keys 0 .. start + i (causal, aligned to the last key).
 *
 * Per KV head, the keys and values it needs are first packed into bf16 tiles (the block table is read here
 * only; the tiles are contiguous): keys in the dot product's layout, [16 keys][dim/2 pairs] transposed to
 * [dim/2 pairs][16 keys] so that one instruction gives 16 keys' partial scores over two dims; values as
 * [key pairs][dim] with the two keys of a pair interleaved, so that one instruction adds two keys' weighted
 * values to 16 dims.  The query rows (every query head of the KV head's group, for each token) are then
 * walked ROWS at a time over tiles of 32 keys with an online softmax (FlashAttention's running maximum m,
 * normaliser l and accumulator o, kept in registers for the whole walk where they fit):
 *   l' = l e^(m - m') + sum_t e^(s_t - m');  o' = o e^(m - m') + sum_t e^(s_t - m') v_t
 * with the weights e^(s_t - m') rounded to bf16 for the product, and m' = max_t s_t only where that exceeds m by a
 * margin, else m' = m (walk_rows).  Work is split over OpenMP threads by
 * (KV head, range of rows), several ranges per thread taken in turn (a later row attends more keys); a row's
 * result never depends on `threads` or on the other rows.
 * Compiled with -ffast-math; subnormals are flushed only inside the call.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_prefill.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define HAVE_BF16_DOT 1
#include <immintrin.h>
#else
#define HAVE_BF16_DOT 0
#endif

#define TILE 32 /* keys per step of the walk: two vectors of 16 scores */
#define ROWS 4  /* query rows a walk takes at once (two measured slower at every head size) */
#define QP_STRIDE 64 /* uint32 (bf16 pairs) per packed query row: dim <= 128 */

/* 1 when this build has the bf16 dot-product kernel (the CPU has AVX512-BF16), else 0. */
int paged_prefill_has_bf16(void) { return HAVE_BF16_DOT; }

/* 1 when the kernel takes this model shape, else 0. */
int paged_prefill_supports(int heads, int kv_heads, int dim, int block_size) {
    return heads > 0 && kv_heads > 0 && heads <= PREFILL_MAX_HEADS && heads % kv_heads == 0 && dim >= 16 &&
           dim % 16 == 0 && dim <= 128 && block_size > 0 && block_size <= PREFILL_MAX_BLOCK;
}

#if HAVE_BF16_DOT
/* Element i from p (fp16 when `f16`, else fp32). */
#define AT(p, i) ((const void *)((const char *)(p) + (int64_t)(i) * (f16 ? 2 : 4)))

/* One row of `dim` cache elements as dim/2 bf16 pairs (uint32 each: element 2j low, 2j + 1 high). */
INLINE void row_bf16(uint32_t *restrict dst, const void *restrict src, const int dim, const int f16) {
    int d = 0;
    for (; d + 32 <= dim; d += 32) {
        const __m512 lo = load16((const char *)src + (int64_t)d * (f16 ? 2 : 4), f16);
        const __m512 hi = load16((const char *)src + (int64_t)(d + 16) * (f16 ? 2 : 4), f16);
        _mm512_storeu_si512(dst + d / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    if (d < dim) /* a last 16 */
        _mm256_storeu_si256((__m256i *)(dst + d / 2),
                            (__m256i)_mm512_cvtneps_pbh(load16((const char *)src + (int64_t)d * (f16 ? 2 : 4), f16)));
}

/* 16 or 32 cache elements from p (32 when `two`) as bf16 in one vector (the upper half zero for 16). */
INLINE __m512i load_bf16(const void *p, const int two, const int f16) {
    if (!two) return _mm512_zextsi256_si512((__m256i)_mm512_cvtneps_pbh(load16(p, f16)));
    return (__m512i)_mm512_cvtne2ps_pbh(load16((const char *)p + 16 * (f16 ? 2 : 4), f16), load16(p, f16));
}

/* r[i] holds row i of a 16 x 16 matrix of 32-bit elements; afterwards r[i] holds column i. */
INLINE void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) { /* pairs of rows, interleaved by element */
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) /* quads of rows, interleaved by pairs */
        for (int j = 0; j < 2; j++) {
            r[i + 2 * j] = _mm512_unpacklo_epi64(t[i + j], t[i + 2 + j]);
            r[i + 2 * j + 1] = _mm512_unpackhi_epi64(t[i + j], t[i + 2 + j]);
        }
    for (int i = 0; i < 16; i += 8) /* 128-bit lanes of two quads */
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + 4 + j], 0x88);
            t[i + 4 + j] = _mm512_shuffle_i32x4(r[i + j], r[i + 4 + j], 0xdd);
        }
    for (int j = 0; j < 8; j++) { /* 128-bit lanes of the two halves */
        r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
    }
}

/* Keys 0 .. nk - 1 of head h into kp: per tile of 16 keys, [dim/2 pairs][16 keys] uint32 (bf16 pairs); keys
 * from nk up to the next multiple of TILE are zero (masked by the walk). */
INLINE void pack_keys(uint32_t *restrict kp, const void *k_cache, const int64_t *table, int64_t nk, int bs,
                      int kv_heads, int h, const int dim, const int f16) {
    uint32_t rows[16][QP_STRIDE] __attribute__((aligned(64)));
    memset(rows, 0, sizeof(rows)); /* pairs past dim / 2 are transposed too, never stored */
    for (int64_t t0 = 0; t0 < (nk + TILE - 1) / TILE * TILE; t0 += 16) {
        const int n = nk - t0 < 16 ? (int)(nk - t0) : 16;
        for (int t = 0; t < 16; t++) {
            if (t < n)
                row_bf16(rows[t], prefill_token_at(k_cache, table, t0 + t, bs, kv_heads, h, dim, f16), dim, f16);
            else
                memset(rows[t], 0, sizeof(uint32_t) * dim / 2);
        }
        uint32_t *tile = kp + t0 * (dim / 2); /* (t0 / 16) * (dim / 2) * 16 */
        for (int p0 = 0; p0 < dim / 2; p0 += 16) {
            __m512i r[16];
            for (int t = 0; t < 16; t++) r[t] = _mm512_load_si512(rows[t] + p0);
            transpose16(r);
            for (int p = p0; p < dim / 2 && p < p0 + 16; p++) _mm512_store_si512(tile + p * 16, r[p - p0]);
        }
    }
}

/* Values 0 .. nk - 1 of head h into vp: per pair of keys, [dim] uint32 whose low half is the first key's value
 * and high half the second's (bf16); keys past nk are zero. */
INLINE void pack_values(uint32_t *restrict vp, const void *v_cache, const int64_t *table, int64_t nk, int bs,
                        int kv_heads, int h, const int dim, const int f16) {
    /* interleave a (first key) and b (second key), 32 bf16 each, into 32 pairs: idx picks a[j], b[j] */
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    const int64_t pairs = (nk + TILE - 1) / TILE * (TILE / 2);
    for (int64_t kp = 0; kp < pairs; kp++) {
        uint32_t *dst = vp + kp * dim;
        for (int d = 0; d < dim; d += 32) {
            const int two = d + 32 <= dim; /* 32 dims, else the last 16 */
            __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
            const int64_t t = 2 * kp;
            if (t < nk)
                a = load_bf16(AT(prefill_token_at(v_cache, table, t, bs, kv_heads, h, dim, f16), d), two, f16);
            if (t + 1 < nk)
                b = load_bf16(AT(prefill_token_at(v_cache, table, t + 1, bs, kv_heads, h, dim, f16), d), two, f16);
            _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(a, lo, b));
            if (two) _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(a, hi, b));
        }
    }
}

/* 2^x for x <= 0 (lanes far below give 0; lanes the walk masks may be anything, it zeroes them): 2^n * 2^f with
 * n = round(x) (simd_math.h; its error far below the bf16 rounding the weights get next). */
INLINE __m512 exp2_neg(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_scalef_ps(EXP2_FRACTION(_mm512_fmadd_ps, _mm512_set1_ps, _mm512_sub_ps(x, n)), n);
}

/* ROWS query rows (row r: qp + r * QP_STRIDE, dim/2 bf16 pairs, attending keys 0 .. last[r]) over the packed keys kp
 * and values vp; writes the rows of output to dst[r].
 *
 * Scores: each row's 32 scores of a tile are summed in four chains (two per 16 keys, even and odd pairs apart), so
 * that 4 ROWS products are in flight, enough to keep both dot-product pipes busy (eight chains left them ~2/3 used).
 * Softmax in base 2: w = 2^((s - m) c) with c = scale * log2(e).  The running maximum m moves only when a tile's
 * score exceeds it by more than RESCALE_AFTER / c (then to that tile's maximum, rescaling o and l); below that the
 * weights are up to 2^RESCALE_AFTER, which neither fp32 sums nor bf16 weights mind, and o / l is the same.  So a
 * tile needs one vector max and compare per row, not a horizontal maximum; l is summed lane-wise and reduced once. */
#define RESCALE_AFTER 8.0f
#define CHAINS 2 /* score chains per row and 16 keys (dim / 2 is a multiple of it): 4 ROWS products in flight */
INLINE void walk_rows(const uint32_t *restrict qp, const int64_t *last, const uint32_t *restrict kp,
                      const uint32_t *restrict vp, float *const *dst, float scale, const int dim) {
    __m512 o[ROWS][8], l[ROWS]; /* ROWS * dim / 16 accumulators: past 16 some stay in L1 */
    float m[ROWS];
    int64_t most = 0, least = INT64_MAX;
    const float c = scale * 1.44269504f, slack = RESCALE_AFTER / c;
    const __m512 cv = _mm512_set1_ps(c);
    for (int r = 0; r < ROWS; r++) {
        for (int j = 0; j < dim / 16; j++) o[r][j] = _mm512_setzero_ps();
        l[r] = _mm512_setzero_ps();
        m[r] = -FLT_MAX;
        most = last[r] > most ? last[r] : most;
        least = last[r] < least ? last[r] : least;
    }
    uint32_t w[ROWS][TILE / 2] __attribute__((aligned(64))); /* the tile's weights as bf16 pairs, per row */
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 lowest = _mm512_set1_ps(-FLT_MAX);
    for (int64_t t0 = 0; t0 <= most; t0 += TILE) {
        __m512 s[ROWS][2][CHAINS]; /* per row and 16 keys, CHAINS sums of every CHAINS-th pair */
        for (int r = 0; r < ROWS; r++)
            for (int e = 0; e < CHAINS; e++) s[r][0][e] = s[r][1][e] = _mm512_setzero_ps();
        const uint32_t *k0 = kp + t0 * (dim / 2), *k1 = k0 + 16 * (dim / 2);
#pragma GCC unroll 8
        for (int p = 0; p < dim / 2; p += CHAINS) {
            for (int e = 0; e < CHAINS; e++) {
                const __m512bh a = (__m512bh)_mm512_load_si512(k0 + (p + e) * 16);
                const __m512bh b = (__m512bh)_mm512_load_si512(k1 + (p + e) * 16);
                for (int r = 0; r < ROWS; r++) {
                    const __m512bh x = (__m512bh)_mm512_set1_epi32((int)qp[r * QP_STRIDE + p + e]);
                    s[r][0][e] = _mm512_dpbf16_ps(s[r][0][e], x, a);
                    s[r][1][e] = _mm512_dpbf16_ps(s[r][1][e], x, b);
                }
            }
        }
        for (int r = 0; r < ROWS; r++)
            for (int e = 1; e < CHAINS; e++) s[r][0][0] = _mm512_add_ps(s[r][0][0], s[r][0][e]),
                                        s[r][1][0] = _mm512_add_ps(s[r][1][0], s[r][1][e]);
        const int masked = t0 + TILE - 1 > least;
        for (int r = 0; r < ROWS; r++) {
            __m512 x0 = s[r][0][0], x1 = s[r][1][0];
            __mmask16 v0 = 0xFFFF, v1 = 0xFFFF;
            if (masked) {
                const __m512i limit = _mm512_set1_epi32((int)(last[r] - t0 < TILE ? last[r] - t0 : TILE));
                v0 = _mm512_cmple_epi32_mask(lane, limit);
                v1 = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16)), limit);
                x0 = _mm512_mask_mov_ps(lowest, v0, x0);
                x1 = _mm512_mask_mov_ps(lowest, v1, x1);
            }
            const __m512 top = _mm512_max_ps(x0, x1);
            if (_mm512_cmp_ps_mask(top, _mm512_set1_ps(m[r] + slack), _CMP_GT_OQ)) {
                const float mx = _mm512_reduce_max_ps(top);
                const float drop = fmaxf((m[r] - mx) * c, -200.0f); /* the first time m is -FLT_MAX */
                const __m512 shrink = exp2_neg(_mm512_set1_ps(drop));
                for (int j = 0; j < dim / 16; j++) o[r][j] = _mm512_mul_ps(o[r][j], shrink);
                l[r] = _mm512_mul_ps(l[r], shrink);
                m[r] = mx;
            }
            const __m512 mc = _mm512_set1_ps(m[r] * c);
            __m512 p0 = exp2_neg(_mm512_fmsub_ps(x0, cv, mc)), p1 = exp2_neg(_mm512_fmsub_ps(x1, cv, mc));
            if (masked) /* their scores are -FLT_MAX: weights of 0, or NaN where c > 1 makes them -inf */
                p0 = _mm512_maskz_mov_ps(v0, p0), p1 = _mm512_maskz_mov_ps(v1, p1);
            l[r] = _mm512_add_ps(l[r], _mm512_add_ps(p0, p1));
            _mm512_store_si512(w[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
        const uint32_t *v = vp + (t0 / 2) * dim;
#pragma GCC unroll 4
        for (int j = 0; j < TILE / 2; j++) {
            for (int c16 = 0; c16 < dim / 16; c16++) {
                const __m512bh y = (__m512bh)_mm512_load_si512(v + j * dim + c16 * 16);
                for (int r = 0; r < ROWS; r++)
                    o[r][c16] = _mm512_dpbf16_ps(o[r][c16], (__m512bh)_mm512_set1_epi32((int)w[r][j]), y);
            }
        }
    }
    for (int r = 0; r < ROWS; r++) {
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(l[r]));
        for (int j = 0; j < dim / 16; j++) _mm512_storeu_ps(dst[r] + j * 16, _mm512_mul_ps(o[r][j], inv));
    }
}

/* Every row of KV head h (rows ordered token by token, the group's query heads within a token), ROWS at a time
 * from row r0 to r1; the last block of rows repeats its last row to fill ROWS (its copies are not written). */
INLINE void attend_rows(const float *q, float *out, const uint32_t *kp, const uint32_t *vp, int64_t start, int heads,
                        int group, int h, int64_t r0, int64_t r1, float scale, const int dim) {
    uint32_t qp[ROWS][QP_STRIDE] __attribute__((aligned(64)));
    float scratch[128] __attribute__((aligned(64)));
    for (int64_t r = r0; r < r1; r += ROWS) {
        int64_t last[ROWS];
        float *dst[ROWS];
        for (int i = 0; i < ROWS; i++) {
            const int64_t row = r + i < r1 ? r + i : r1 - 1, token = row / group;
            const int64_t at = (token * heads + h * group + row % group) * dim;
            row_bf16(qp[i], q + at, dim, 0);
            last[i] = start + token;
            dst[i] = r + i < r1 ? out + at : scratch;
        }
        walk_rows(qp[0], last, kp, vp, dst, scale, dim);
    }
}

INLINE int paged_prefill(const float *q, const void *k_cache, const void *v_cache, int64_t num_blocks,
                         const int64_t *table, int width, int64_t start, int n, float *out, int heads, int kv_heads,
                         int dim, int block_size, float scale, int threads, const int f16) {
    if (!paged_prefill_supports(heads, kv_heads, dim, block_size)) return -1;
    const int checked = prefill_check_chunk(table, width, num_blocks, start, n, block_size);
    if (checked != 0) return checked;
    const int64_t nk = start + n;
    const int group = heads / kv_heads;
    const int64_t padded = (nk + TILE - 1) / TILE * TILE, per_head = padded * dim / 2; /* uint32 per head */
    uint32_t *kp = prefill_scratch(2 * sizeof(uint32_t) * per_head * kv_heads); /* keys, then values */
    if (kp == NULL) return -3;
    uint32_t *vp = kp + per_head * kv_heads;
    const int64_t rows = (int64_t)n * group, blocks = (rows + ROWS - 1) / ROWS;
    const int64_t parts = prefill_parts(blocks, threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const unsigned csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040); /* FTZ | DAZ, this thread only */
#pragma omp for schedule(static)
        for (int h = 0; h < kv_heads; h++) {
            pack_keys(kp + h * per_head, k_cache, table, nk, block_size, kv_heads, h, dim, f16);
            pack_values(vp + h * per_head, v_cache, table, nk, block_size, kv_heads, h, dim, f16);
        }
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int h = 0; h < kv_heads; h++)
            for (int64_t part = 0; part < parts; part++) {
                const int64_t r0 = blocks * part / parts * ROWS, r1 = blocks * (part + 1) / parts * ROWS;
                const int64_t end = r1 < rows ? r1 : rows;
                const uint32_t *hk = kp + h * per_head, *hv = vp + h * per_head;
                if (dim == 64) /* the common sizes as constants: their loops unroll into whole vectors */
                    attend_rows(q, out, hk, hv, start, heads, group, h, r0, end, scale, 64);
                else if (dim == 128)
                    attend_rows(q, out, hk, hv, start, heads, group, h, r0, end, scale, 128);
                else
                    attend_rows(q, out, hk, hv, start, heads, group, h, r0, end, scale, dim);
            }
        _mm_setcsr(csr);
    }
    prefill_scratch_done(kp);
    return 0;
}
#else
#define paged_prefill(...) (-4) /* no bf16 dot products in this build */
#endif

PREFILL_ENTRY_POINTS(paged_prefill, paged_prefill)
