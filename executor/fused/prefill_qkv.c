/* A prefill step's queries, keys and values from its qkv product, in one pass: bias, rotary embedding and the
 * casts the attention and the KV cache want, over an fp16 cache: from a bf16 product (hybrid matrices on CPUs with
 * native bf16, every row of the step multiplied in bf16) or an fp32 one (packed fp16 matrices, bias included;
 * or any product with q and k through Qwen3's q/k norms);
 * queries in bf16 for PyTorch's bf16 flash attention, in fp32 for the compiled prefill kernels.
 *
 * In PyTorch the same takes a widening pass over the product, a bias pass, the rotary's five passes (x * cos,
 * negate, concatenate, * sin, add) on q and on k, and three casts (q to bf16, k and v to fp16).  Here each row is
 * read once and written once, with the same arithmetic in the same order, so every output is bitwise PyTorch's:
 *   x       = float(y) + bias                    (fp32; no bias: float(y), exact; fp32 rows: y + bias, or y)
 *   rot[i]  = x[i] * cos[i] - x[i + h] * sin[i]        i < h = dim / 2   (x * cos + (-x2) * sin)
 *   rot[i + h] = x[i + h] * cos[i + h] + x[i] * sin[i + h]               (x * cos + x1 * sin)
 *   q = bf16(rot_q) or rot_q, k = fp16(rot_k), v = fp16(x_v)   (to nearest, ties to even)
 * each product and sum rounded to fp32 on its own: this file is compiled without -ffast-math and with
 * -ffp-contract=off (kernels/build.py), so no product is fused into an FMA.
 *
 * Layouts (each row contiguous; the inputs' rows `*_stride` elements apart: column slices of one product, or q
 * and k after Qwen3's q/k norms beside the product's v):
 *   q_in   [rows, heads * dim], k_in and v_in [rows, kv_heads * dim]: bf16 bits, or fp32 (in_fp32)
 *   bias   [(heads + 2 * kv_heads) * dim]        fp32, or NULL
 *   cos, sin [rows, dim]                         fp32: each row's position's tables
 *   q      [rows, heads * dim]                   bf16 bits (q_bf16) or fp32
 *   k, v   [rows, kv_heads * dim]                fp16 bits
 * Rows are split over `threads` OpenMP threads.  Returns 0; -2 where the build has no F16C
 * (prefill_qkv_available() says so); -3 for an odd or too large dim.
 */
#include <stdint.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>

#include "../kernels/bf16_round.h"
#endif

#define MAX_DIM 1024

int prefill_qkv_available(void) {
#if defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__F16C__)
/* x[i] = float(y[i]) + bias[i] (bias may be NULL); y holds bf16 bits, or fp32 values where y_fp32. */
static void widen(const void *restrict y, int y_fp32, const float *restrict bias, float *restrict x, int n) {
    if (y_fp32) {
        const float *f = y;
        for (int i = 0; i < n; i++) x[i] = bias ? f[i] + bias[i] : f[i];
        return;
    }
    const uint16_t *b16 = y;
    for (int i = 0; i < n; i++) {
        uint32_t u = (uint32_t)b16[i] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        x[i] = bias ? f + bias[i] : f;
    }
}

static void rotate(const float *restrict x, const float *restrict cos, const float *restrict sin, float *restrict out,
                   int dim) {
    const int h = dim / 2;
    for (int i = 0; i < h; i++) {
        const float a = x[i] * cos[i], b = x[i + h] * sin[i];
        out[i] = a - b;
    }
    for (int i = 0; i < h; i++) {
        const float a = x[i + h] * cos[i + h], b = x[i] * sin[i + h];
        out[i + h] = a + b;
    }
}

static void store_bf16(const float *restrict x, uint16_t *restrict dst, int n) {
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm256_storeu_si256((__m256i *)(dst + i), bf16_of16(_mm512_loadu_ps(x + i)));
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i *)(dst + i), bf16_of8(_mm256_loadu_ps(x + i)));
#endif
    for (; i < n; i++) dst[i] = bf16_of(x[i]);
}

static void store_fp16(const float *restrict x, uint16_t *restrict dst, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) dst[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

enum { TO_FP32, TO_BF16, TO_FP16 };

/* Element `i` from `base`, an array of bf16 bits or of fp32 values. */
static const void *at_elem(const void *base, int fp32, int64_t i) {
    return fp32 ? (const void *)((const float *)base + i) : (const void *)((const uint16_t *)base + i);
}

/* Heads [0, n) of one row: widened from y (+ bias), rotated unless cos is NULL, stored as `to` says. */
static void heads_of(const void *y, int y_fp32, const float *bias, const float *cos, const float *sin, int n, int dim,
                     int to, void *dst) {
    float x[MAX_DIM], rot[MAX_DIM];
    for (int hd = 0; hd < n; hd++) {
        const int64_t at = (int64_t)hd * dim;
        widen(at_elem(y, y_fp32, at), y_fp32, bias ? bias + at : NULL, x, dim);
        if (cos) rotate(x, cos, sin, rot, dim);
        const float *out = cos ? rot : x;
        if (to == TO_FP32)
            memcpy((float *)dst + at, out, sizeof(float) * dim);
        else if (to == TO_BF16)
            store_bf16(out, (uint16_t *)dst + at, dim);
        else
            store_fp16(out, (uint16_t *)dst + at, dim);
    }
}
#endif

int prefill_qkv(const void *q_in, const void *k_in, const void *v_in, int64_t q_stride, int64_t k_stride,
                int64_t v_stride, int in_fp32, const float *bias, const float *cos, const float *sin, int64_t rows,
                int heads, int kv_heads, int dim, void *q, int q_bf16, uint16_t *k, uint16_t *v, int threads) {
#if defined(__F16C__)
    if (dim <= 0 || dim % 2 || dim > MAX_DIM) return -3;
    const int64_t q_size = (int64_t)heads * dim, kv_size = (int64_t)kv_heads * dim;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * dim, *s = sin + r * dim;
        void *qr = q_bf16 ? (void *)((uint16_t *)q + r * q_size) : (void *)((float *)q + r * q_size);
        heads_of(at_elem(q_in, in_fp32, r * q_stride), in_fp32, bias, c, s, heads, dim, q_bf16 ? TO_BF16 : TO_FP32,
                 qr);
        heads_of(at_elem(k_in, in_fp32, r * k_stride), in_fp32, bias ? bias + q_size : NULL, c, s, kv_heads, dim,
                 TO_FP16, k + r * kv_size);
        heads_of(at_elem(v_in, in_fp32, r * v_stride), in_fp32, bias ? bias + q_size + kv_size : NULL, NULL, NULL,
                 kv_heads, dim, TO_FP16, v + r * kv_size);
    }
    return 0;
#else
    (void)q_in, (void)k_in, (void)v_in, (void)q_stride, (void)k_stride, (void)v_stride, (void)in_fp32, (void)bias;
    (void)cos, (void)sin, (void)rows, (void)heads, (void)kv_heads, (void)dim, (void)q, (void)q_bf16, (void)k, (void)v;
    (void)threads;
    return -2;
#endif
}
