/* Gathering a sequence's keys or values from an fp16 paged cache as bf16, in one pass.
 *
 * PyTorch's bf16 flash attention (the `torch-bf16` prefill attention on AMX) needs the cached keys and values in
 * bf16; the cache holds them in fp16.  In PyTorch that is a gather (index_select) and two casts (fp16 -> fp32 ->
 * bf16, faster than its direct fp16 -> bf16 cast), four passes over the tensor and two fp32 copies of it; here one:
 * each fp16 value is widened to fp32 (exact) and rounded to bf16 to nearest, ties to even, as PyTorch's cast does,
 * so the result is bitwise PyTorch's for every value, NaN made 0xffff as PyTorch's vectorised casts make it (its
 * scalar cast writes 0x7fc0: tests only ask a NaN to stay one).  fp16 has no value that is subnormal in fp32.
 *
 * Layouts (all contiguous):
 *   cache   [num_blocks, block_size, token_elems]   fp16 bits (token_elems = kv_heads * dim)
 *   blocks  [>= ceil(n / block_size)]               int64 block ids, in the sequence's order
 *   out     [n, token_elems]                        bf16 bits: the sequence's first n tokens
 * 16 values at a time on AVX-512, 8 on AVX2, then one by one; blocks are split over `threads` OpenMP threads.
 * Returns 0; -1 for a block id outside [0, num_blocks) (nothing written); -2 where the build has no F16C
 * (gather_bf16_available() says so).
 */
#include <stdint.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

int gather_bf16_available(void) {
#if defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__F16C__)
#include "../kernels/bf16_round.h"

static void convert(const uint16_t *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            bf16_of16(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i)))));
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), bf16_of8(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i)))));
#endif
    for (; i < n; i++) dst[i] = bf16_of(_cvtsh_ss(src[i]));
}
#endif

int gather_bf16(const uint16_t *cache, int64_t num_blocks, const int64_t *blocks, int64_t n, int64_t block_size,
                int64_t token_elems, uint16_t *out, int threads) {
#if defined(__F16C__)
    const int64_t block_elems = block_size * token_elems, n_blocks = (n + block_size - 1) / block_size;
    for (int64_t b = 0; b < n_blocks; b++)
        if (blocks[b] < 0 || blocks[b] >= num_blocks) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < n_blocks; b++) {
        const int64_t rows = n - b * block_size < block_size ? n - b * block_size : block_size;
        convert(cache + blocks[b] * block_elems, out + b * block_elems, rows * token_elems);
    }
    return 0;
#else
    (void)cache, (void)num_blocks, (void)blocks, (void)n, (void)block_size, (void)token_elems, (void)out, (void)threads;
    return -2;
#endif
}
