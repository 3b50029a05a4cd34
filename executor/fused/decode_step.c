/* One decode step of a Llama/Qwen decoder in a single call, for CPUs: every layer's norms, products, rotary
 * embedding, cache writes, attention (paged_decode.c's kernel), SwiGLU and residuals, then the final norm.
 * PyTorch's eager decode spends about as long dispatching its ~35 small operations per layer as the products
 * themselves take on a small model; here each layer is a few loops over memory the step already holds.
 *
 * Matrices are the checkpoint's 16-bit values, row-major [rows, cols] (bf16 or IEEE fp16, per matrix), widened
 * to fp32 on load; activations and accumulation are fp32 throughout (as the packed fp16 product).  Rows are
 * taken four at a time and sequences two at a time, so each loaded weight vector feeds eight FMAs; every
 * product prefetches its matrix a fixed distance ahead into L2 (the rows of a small matrix span few pages,
 * which the hardware prefetcher does not cross).  With `threads` > 1 each product's rows are split between
 * OpenMP threads.  Needs AVX2, FMA and F16C (fused_decode_available() says whether this build has them).
 *
 * Layouts (all contiguous): x [batch, hidden] the embedded tokens, overwritten with the residual stream;
 * out [batch, hidden] the final-normed hidden states; positions, slots [batch]; tables [batch, width] and
 * lens [batch] as paged_decode.c (lens count the new token); caches [num_blocks, block_size, kv_heads, dim];
 * cos/sin [max_positions, dim]; scratch: fused_decode_scratch(model, batch) floats.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "helper.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_FUSED 1
#else
#define HAVE_FUSED 0
#endif

typedef struct {
    const uint16_t *w;   /* [rows, cols] 16-bit */
    const float *bias;   /* [rows] or NULL */
    int64_t rows, cols;
    int bf16;            /* 1: bf16 values, 0: IEEE fp16 */
} Mat;

typedef struct {
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* q_norm/k_norm NULL without q/k norm */
    Mat qkv, o, gate_up, down;
    void *k_cache, *v_cache;
} Layer;

typedef struct {
    int hidden, heads, kv_heads, dim, inter, num_layers, block_size, cache_f16;
    float eps, scale;
    int64_t num_blocks, max_positions;
    const float *cos, *sin, *final_norm;
    const Layer *layers;
} Model;

int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, int64_t num_blocks,
                     const int64_t *tables, const int64_t *lens, float *out, int batch, int heads, int kv_heads,
                     int dim, int block_size, int width, float scale, int threads);
int paged_decode_f16(const float *q, const uint16_t *k_cache, const uint16_t *v_cache, int64_t num_blocks,
                     const int64_t *tables, const int64_t *lens, float *out, int batch, int heads, int kv_heads,
                     int dim, int block_size, int width, float scale, int threads);
int paged_decode_heads(const float *q, const void *k_cache, const void *v_cache, int64_t num_blocks,
                       const int64_t *table, const int64_t *len, float *out, int heads, int kv_heads, int kv0, int kv1,
                       int dim, int block_size, int width, float scale, int cache_f16);

int fused_decode_available(void) { return HAVE_FUSED; }

#define HELPER_CHUNKS 16 /* a shared product's chunks (fewer for small matrices): the lane thread waits ~2 at most */

/* Row groups of four in each chunk of a shared product of `rows` rows. */
static int64_t chunk_groups(int64_t rows) {
    const int64_t groups = (rows + 3) / 4;
    return (groups + HELPER_CHUNKS - 1) / HELPER_CHUNKS;
}

/* Floats of the largest chunk steps of up to max_batch sequences give a helper (its private buffer): a product
 * chunk's rows for every sequence, or one sequence's attention. */
int64_t fused_helper_chunk_floats(const Model *m, int max_batch) {
    int64_t most = (int64_t)m->heads * m->dim;
    for (int i = 0; i < m->num_layers; i++) {
        const Mat *mats[4] = {&m->layers[i].qkv, &m->layers[i].o, &m->layers[i].gate_up, &m->layers[i].down};
        for (int j = 0; j < 4; j++) {
            const int64_t floats = (int64_t)max_batch * 4 * chunk_groups(mats[j]->rows);
            most = floats > most ? floats : most;
        }
    }
    return most;
}

/* Floats of scratch a step of `batch` sequences needs. */
int64_t fused_decode_scratch(const Model *m, int batch) {
    const int64_t q = (int64_t)m->heads * m->dim, kv = (int64_t)m->kv_heads * m->dim;
    return (int64_t)batch * (m->hidden + (q + 2 * kv) + 2 * q + 2 * (int64_t)m->inter + m->inter);
}

#if HAVE_FUSED
#define INLINE static inline __attribute__((always_inline))
#define PREFETCH_BYTES 16384 /* 8-32 KB, L1/L2/L3 hints: within 2 % of each other; none: 1.7-2x slower */

#if defined(__AVX512F__)
#define VL 16
typedef __m512 vf;
INLINE vf widen(const uint16_t *p, const int bf16) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}
#define LOADX(p) _mm512_loadu_ps(p)
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define ZERO() _mm512_setzero_ps()
INLINE float hsum(vf v) { return _mm512_reduce_add_ps(v); }
#else
#define VL 8
typedef __m256 vf;
INLINE vf widen(const uint16_t *p, const int bf16) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}
#define LOADX(p) _mm256_loadu_ps(p)
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define ZERO() _mm256_setzero_ps()
INLINE float hsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}
#endif

/* Floats per vector in this build's products: 16 (AVX-512), 8 (AVX2); 0 without the fused step (below). */
int fused_decode_lanes(void) { return VL; }

INLINE float widen1(uint16_t v, const int bf16) {
    if (bf16) {
        const uint32_t u = (uint32_t)v << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return _cvtsh_ss(v);
}

/* Four rows of `a` (from row r) against sequences b and, with `two`, b + 1: sums into s0 and s1. */
INLINE void four_rows(const Mat *a, int64_t r, const float *x0, const float *x1, float s0[4], float s1[4],
                      const int prefetch, const int two, const int bf16) {
    const int64_t n = a->cols, vec_end = n - n % VL;
    const uint16_t *w0 = a->w + r * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
    const char *ahead = (const char *)w0 + PREFETCH_BYTES;
    vf a00 = ZERO(), a01 = ZERO(), a02 = ZERO(), a03 = ZERO();
    vf a10 = ZERO(), a11 = ZERO(), a12 = ZERO(), a13 = ZERO();
    for (int64_t k = 0; k < vec_end; k += VL) {
        if (prefetch && (k & 31) == 0) { /* 4 rows x 32 values = 256 bytes per 32 columns */
            _mm_prefetch(ahead + 8 * k, _MM_HINT_T1);
            _mm_prefetch(ahead + 8 * k + 64, _MM_HINT_T1);
            _mm_prefetch(ahead + 8 * k + 128, _MM_HINT_T1);
            _mm_prefetch(ahead + 8 * k + 192, _MM_HINT_T1);
        }
        const vf v0 = widen(w0 + k, bf16), v1 = widen(w1 + k, bf16), v2 = widen(w2 + k, bf16),
                 v3 = widen(w3 + k, bf16);
        const vf p = LOADX(x0 + k);
        a00 = FMA(v0, p, a00), a01 = FMA(v1, p, a01), a02 = FMA(v2, p, a02), a03 = FMA(v3, p, a03);
        if (two) {
            const vf q = LOADX(x1 + k);
            a10 = FMA(v0, q, a10), a11 = FMA(v1, q, a11), a12 = FMA(v2, q, a12), a13 = FMA(v3, q, a13);
        }
    }
    s0[0] = hsum(a00), s0[1] = hsum(a01), s0[2] = hsum(a02), s0[3] = hsum(a03);
    if (two) s1[0] = hsum(a10), s1[1] = hsum(a11), s1[2] = hsum(a12), s1[3] = hsum(a13);
    for (int64_t k = vec_end; k < n; k++) {
        const float w[4] = {widen1(w0[k], bf16), widen1(w1[k], bf16), widen1(w2[k], bf16), widen1(w3[k], bf16)};
        for (int i = 0; i < 4; i++) {
            s0[i] += w[i] * x0[k];
            if (two) s1[i] += w[i] * x1[k];
        }
    }
}

/* y[b * ld + r - r0] = x[b, :] . w[r, :] (+ bias[r]) for rows r0..r1 (r1 - r0 a multiple of 4 except at the end):
 * rows four at a time, sequences two at a time (each widened weight vector feeds eight FMAs). */
INLINE void rows_of(const Mat *a, const float *x, float *y, int64_t ld, int batch, int64_t r0, int64_t r1,
                    const int bf16) {
    const int64_t n = a->cols;
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        for (int b = 0; b < batch; b += 2) {
            const int two = b + 1 < batch;
            const float *x0 = x + (int64_t)b * n;
            float s0[4], s1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (two)
                four_rows(a, r, x0, x0 + n, s0, s1, b == 0, 1, bf16);
            else
                four_rows(a, r, x0, x0, s0, s1, b == 0, 0, bf16);
            for (int i = 0; i < 4; i++) {
                const float bias = a->bias ? a->bias[r + i] : 0.0f;
                y[(int64_t)b * ld + r - r0 + i] = s0[i] + bias;
                if (two) y[(int64_t)(b + 1) * ld + r - r0 + i] = s1[i] + bias;
            }
        }
    }
    for (; r < r1; r++) { /* fewer than four rows left */
        const uint16_t *w = a->w + r * n;
        for (int b = 0; b < batch; b++) {
            float s = 0.0f;
            for (int64_t k = 0; k < n; k++) s += widen1(w[k], bf16) * x[(int64_t)b * n + k];
            y[(int64_t)b * ld + r - r0] = s + (a->bias ? a->bias[r] : 0.0f);
        }
    }
}

static void some_rows(const Mat *a, const float *x, float *y, int64_t ld, int batch, int64_t r0, int64_t r1) {
    if (a->bf16)
        rows_of(a, x, y, ld, batch, r0, r1, 1);
    else
        rows_of(a, x, y, ld, batch, r0, r1, 0);
}

static int product(const Mat *a, const float *x, float *y, int batch, int threads, Helper *helper) {
    const int64_t groups = (a->rows + 3) / 4;
    if (helper != NULL && groups > 1) {
        const int64_t per = chunk_groups(a->rows);
        FusedJob job = {.kind = JOB_PRODUCT, .chunks = (int)((groups + per - 1) / per), .batch = batch,
                        .chunk_rows = 4 * per, .mat = a, .x = x, .y = y};
        return helper_share(helper, &job);
    }
    const int parts = threads > 1 ? threads : 1;
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
    for (int t = 0; t < parts; t++) {
        const int64_t r0 = 4 * (groups * t / parts), r1 = 4 * (groups * (t + 1) / parts);
        some_rows(a, x, y + r0, a->rows, batch, r0, r1 < a->rows ? r1 : a->rows);
    }
    return 0;
}

/* out[i] = weight[i] * (x[i] / sqrt(mean(x^2) + eps)) over n values. */
static void rms_norm(const float *x, const float *weight, float *out, int n, float eps) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++) out[i] = weight[i] * (x[i] * r);
}

/* Rotate-half RoPE of one head in place: x * cos + cat(-x2, x1) * sin. */
static void rotate(float *x, const float *cos, const float *sin, int dim) {
    const int half = dim / 2;
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

static void store_kv(void *cache, int64_t slot, const float *src, int n, int f16) {
    if (f16) {
        uint16_t *dst = (uint16_t *)cache + slot * n;
        for (int i = 0; i < n; i++) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
    } else {
        memcpy((float *)cache + slot * n, src, sizeof(float) * n);
    }
}

/* Attention of sequences b0 .. b1 - 1 into out (rows of heads * dim floats). */
static int attend(const Model *m, const Layer *L, const float *q, const int64_t *tables, const int64_t *lens,
                  int width, int b0, int b1, float *out, int threads) {
    const int64_t q_size = (int64_t)m->heads * m->dim;
    const float *qb = q + b0 * q_size;
    const int64_t *tb = tables + (int64_t)b0 * width, *lb = lens + b0;
    return m->cache_f16
        ? paged_decode_f16(qb, L->k_cache, L->v_cache, m->num_blocks, tb, lb, out, b1 - b0, m->heads, m->kv_heads,
                           m->dim, m->block_size, width, m->scale, threads)
        : paged_decode_f32(qb, L->k_cache, L->v_cache, m->num_blocks, tb, lb, out, b1 - b0, m->heads, m->kv_heads,
                           m->dim, m->block_size, width, m->scale, threads);
}

/* An attention job's chunks per sequence; chunk c attends KV heads [*kv0, *kv1) of sequence c / that count. */
static int chunk_heads(const FusedJob *job, int c, int *kv0, int *kv1) {
    const int kv_heads = ((const Model *)job->model)->kv_heads, per = job->kv_per_chunk;
    const int parts = (kv_heads + per - 1) / per;
    *kv0 = c % parts * per;
    *kv1 = *kv0 + per < kv_heads ? *kv0 + per : kv_heads;
    return parts;
}

ChunkPlace fused_chunk_place(const FusedJob *job, int c) {
    if (job->kind == JOB_PRODUCT) {
        const int64_t rows = ((const Mat *)job->mat)->rows, r0 = c * job->chunk_rows;
        const int64_t r1 = r0 + job->chunk_rows < rows ? r0 + job->chunk_rows : rows;
        return (ChunkPlace){.offset = r0, .len = r1 - r0, .stride = rows, .segments = job->batch};
    }
    const Model *m = job->model;
    const int64_t q_size = (int64_t)m->heads * m->dim, head_rows = (int64_t)(m->heads / m->kv_heads) * m->dim;
    int kv0, kv1;
    const int parts = chunk_heads(job, c, &kv0, &kv1);
    const int64_t len = (kv1 - kv0) * head_rows;
    return (ChunkPlace){.offset = c / parts * q_size + kv0 * head_rows, .len = len, .stride = len, .segments = 1};
}

int fused_run_chunk(const FusedJob *job, int c, float *out, int64_t ld) {
    if (job->kind == JOB_PRODUCT) {
        const Mat *a = job->mat;
        const ChunkPlace p = fused_chunk_place(job, c);
        some_rows(a, job->x, out, ld, job->batch, p.offset, p.offset + p.len);
        return 0;
    }
    const Model *m = job->model;
    const Layer *L = job->layer;
    int kv0, kv1;
    const int parts = chunk_heads(job, c, &kv0, &kv1), b = c / parts;
    if (parts == 1) return attend(m, L, job->x, job->tables, job->lens, job->width, b, b + 1, out, 1);
    const ChunkPlace p = fused_chunk_place(job, c);
    const float *q = job->x + p.offset; /* the queries lie as the output: [batch, heads, dim] */
    const int64_t *table = job->tables + (int64_t)b * job->width, *len = job->lens + b;
    return paged_decode_heads(q, L->k_cache, L->v_cache, m->num_blocks, table, len, out, m->heads, m->kv_heads, kv0,
                              kv1, m->dim, m->block_size, job->width, m->scale, m->cache_f16);
}

static int layer_step(const Model *m, const Layer *L, float *x, const int64_t *positions, const int64_t *slots,
                      const int64_t *tables, const int64_t *lens, int width, int batch, float *scratch,
                      int threads, Helper *helper) {
    const int H = m->hidden, D = m->dim, q_size = m->heads * D, kv_size = m->kv_heads * D;
    const int qkv_rows = q_size + 2 * kv_size;
    float *h = scratch, *qkv = h + (int64_t)batch * H, *q = qkv + (int64_t)batch * qkv_rows;
    float *attn = q + (int64_t)batch * q_size, *gu = attn + (int64_t)batch * q_size;
    float *act = gu + (int64_t)batch * 2 * m->inter;
    int rc;
    for (int b = 0; b < batch; b++) rms_norm(x + (int64_t)b * H, L->input_norm, h + (int64_t)b * H, H, m->eps);
    if ((rc = product(&L->qkv, h, qkv, batch, threads, helper)) != 0) return rc;
    for (int b = 0; b < batch; b++) {
        float *row = qkv + (int64_t)b * qkv_rows, *k = row + q_size, *v = k + kv_size;
        const float *cos = m->cos + positions[b] * D, *sin = m->sin + positions[b] * D;
        for (int i = 0; i < m->heads; i++) {
            if (L->q_norm) rms_norm(row + i * D, L->q_norm, row + i * D, D, m->eps);
            rotate(row + i * D, cos, sin, D);
        }
        for (int i = 0; i < m->kv_heads; i++) {
            if (L->k_norm) rms_norm(k + i * D, L->k_norm, k + i * D, D, m->eps);
            rotate(k + i * D, cos, sin, D);
        }
        store_kv(L->k_cache, slots[b], k, kv_size, m->cache_f16);
        store_kv(L->v_cache, slots[b], v, kv_size, m->cache_f16);
        memcpy(q + (int64_t)b * q_size, row, sizeof(float) * q_size); /* [batch, heads, dim] for the kernel */
    }
    if (helper != NULL && (batch > 1 || m->kv_heads > 1) && batch <= HELPER_MAX_CHUNKS) {
        /* a sequence a chunk (the kernel's result is the same alone or batched), or one sequence's KV heads in up to
         * HELPER_CHUNKS chunks (each head's walk is its own) */
        const int per = batch > 1 ? m->kv_heads : (m->kv_heads + HELPER_CHUNKS - 1) / HELPER_CHUNKS;
        const int parts = (m->kv_heads + per - 1) / per;
        FusedJob job = {.kind = JOB_ATTENTION, .chunks = batch * parts, .batch = batch, .width = width,
                        .kv_per_chunk = per, .model = m, .layer = L, .x = q, .y = attn, .tables = tables,
                        .lens = lens};
        rc = helper_share(helper, &job);
    } else {
        rc = attend(m, L, q, tables, lens, width, 0, batch, attn, threads);
    }
    if (rc != 0) return rc;
    if ((rc = product(&L->o, attn, h, batch, threads, helper)) != 0) return rc;
    for (int64_t i = 0; i < (int64_t)batch * H; i++) x[i] += h[i];
    for (int b = 0; b < batch; b++) rms_norm(x + (int64_t)b * H, L->post_norm, h + (int64_t)b * H, H, m->eps);
    if ((rc = product(&L->gate_up, h, gu, batch, threads, helper)) != 0) return rc;
    const int I = m->inter;
    for (int b = 0; b < batch; b++) {
        const float *g = gu + (int64_t)b * 2 * I, *u = g + I;
        float *a = act + (int64_t)b * I;
        for (int i = 0; i < I; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    if ((rc = product(&L->down, act, h, batch, threads, helper)) != 0) return rc;
    for (int64_t i = 0; i < (int64_t)batch * H; i++) x[i] += h[i];
    return 0;
}
#endif

/* Returns 0; -2 for a position, slot, length or block id outside the model or cache (checked before anything
 * is written), -5 where this build has no fused step, else paged_decode's error.  With a helper (NULL: none) on a
 * one-thread step it shares the step (helper.c), on its own scratch; `scratch` is then not touched. */
int fused_decode(const Model *m, float *x, float *out, const int64_t *positions, const int64_t *slots,
                 const int64_t *tables, const int64_t *lens, int width, int batch, float *scratch, int threads,
                 Helper *helper) {
#if HAVE_FUSED
    const int64_t capacity = m->num_blocks * m->block_size;
    for (int b = 0; b < batch; b++) {
        if (positions[b] < 0 || positions[b] >= m->max_positions || slots[b] < 0 || slots[b] >= capacity)
            return -2;
        if (lens[b] < 1 || lens[b] > (int64_t)width * m->block_size) return -2;
        for (int64_t j = 0; j < (lens[b] + m->block_size - 1) / m->block_size; j++)
            if (tables[(int64_t)b * width + j] < 0 || tables[(int64_t)b * width + j] >= m->num_blocks) return -2;
    }
    if (helper != NULL && (threads > 1 || !helper_step_begin(helper, batch, width, tables, lens, &tables, &lens,
                                                             &scratch)))
        helper = NULL;
    int rc = 0;
    for (int i = 0; i < m->num_layers && rc == 0; i++)
        rc = layer_step(m, &m->layers[i], x, positions, slots, tables, lens, width, batch, scratch, threads, helper);
    if (helper != NULL) helper_step_end(helper);
    if (rc != 0) return rc;
    for (int b = 0; b < batch; b++)
        rms_norm(x + (int64_t)b * m->hidden, m->final_norm, out + (int64_t)b * m->hidden, m->hidden, m->eps);
    return 0;
#else
    (void)m, (void)x, (void)out, (void)positions, (void)slots, (void)tables, (void)lens, (void)width, (void)batch,
        (void)scratch, (void)threads, (void)helper;
    return -5;
#endif
}

#if !HAVE_FUSED
int fused_decode_lanes(void) { return 0; }
ChunkPlace fused_chunk_place(const FusedJob *job, int c) {
    (void)job, (void)c;
    return (ChunkPlace){0, 0, 0, 0};
}
int fused_run_chunk(const FusedJob *job, int c, float *out, int64_t ld) {
    (void)job, (void)c, (void)out, (void)ld;
    return -5;
}
#endif
