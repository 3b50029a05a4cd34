/* What the two CPU prefill-attention kernels share (paged_prefill.c: products in bf16 on AVX512-BF16;
 * paged_prefill_fp32.c: in fp32 on AVX2): a token's address through the block table, the checks of a chunk
 * against its table and the cache, the split of a KV head's rows over threads, the calling thread's working
 * memory, and the pair of entry points (fp16 and fp32 caches) each kernel exports.
 */
#ifndef AGENTSERVE_PAGED_PREFILL_H
#define AGENTSERVE_PAGED_PREFILL_H
#include <stdint.h>
#include <stdlib.h>

#include "simd_math.h"

#define PREFILL_MAX_HEADS 128
#define PREFILL_MAX_BLOCK 64

/* Address of key/value `t` of KV head h in a cache of fp16 (`f16`) or fp32 elements, through the block table. */
INLINE const void *prefill_token_at(const void *cache, const int64_t *table, int64_t t, int bs, int kv_heads, int h,
                                    const int dim, const int f16) {
    const int64_t slot = table[t / bs] * bs + t % bs;
    return (const char *)cache + ((slot * kv_heads + h) * (int64_t)dim) * (f16 ? 2 : 4);
}

/* 0 when a chunk of n tokens from `start` fits the `width` blocks of its table and every block it uses lies in the
 * cache's num_blocks; -2 for an empty chunk or one beyond its table, -5 for a block id outside the cache. */
static inline int prefill_check_chunk(const int64_t *table, int width, int64_t num_blocks, int64_t start, int n,
                                      int block_size) {
    const int64_t used = (start + n + block_size - 1) / block_size;
    if (n < 1 || start < 0 || used > width) return -2;
    for (int64_t j = 0; j < used; j++)
        if (table[j] < 0 || table[j] >= num_blocks) return -5;
    return 0;
}

/* How many ranges a KV head's `units` (groups of rows) are cut into for `threads`: several per thread, taken in
 * turn, since later rows attend more keys (causal); one on one thread. */
static inline int64_t prefill_parts(int64_t units, int threads) {
    return threads > 1 ? (units < 8 * threads ? units : 8 * threads) : 1;
}

/* Working memory of the calling thread's prefill calls (each file that includes this has its own): at least `bytes`,
 * 64-byte aligned, or NULL.  Up to PREFILL_SCRATCH_KEEP bytes it is one buffer per thread, grown when a call needs
 * more and kept for the thread's next calls; past that a call gets its own, which prefill_scratch_done frees.  A
 * buffer allocated and freed on every call was, on some threads, mapped afresh by malloc each time: packing an
 * agent's context (~1.5 MB a layer at 3,000 tokens) then faulted in ~400 new pages a layer. */
#define PREFILL_SCRATCH_KEEP ((size_t)64 << 20)
static __thread void *prefill_scratch_buf;
static __thread size_t prefill_scratch_cap;

static inline void *prefill_scratch(size_t bytes) {
    const size_t rounded = (bytes + 63) / 64 * 64; /* aligned_alloc wants a multiple of the alignment */
    if (rounded > PREFILL_SCRATCH_KEEP) return aligned_alloc(64, rounded);
    if (rounded > prefill_scratch_cap) {
        free(prefill_scratch_buf);
        prefill_scratch_buf = aligned_alloc(64, rounded);
        prefill_scratch_cap = prefill_scratch_buf ? rounded : 0;
    }
    return prefill_scratch_buf;
}

/* A call is done with what prefill_scratch gave it (frees only a buffer past PREFILL_SCRATCH_KEEP). */
static inline void prefill_scratch_done(void *p) {
    if (p != prefill_scratch_buf) free(p);
}

/* The entry points NAME_f16 and NAME_f32 (the cache in fp16 or fp32), both calling IMPL(..., f16).  They return 0;
 * -1 for a shape the kernel refuses, -2 for an empty chunk or one beyond its table, -5 for a block id outside the
 * cache (nothing is written after -1, -2 or -5), -3 when its working memory cannot be allocated, -4 where this
 * build lacks the kernel's instructions. */
#define PREFILL_ENTRY_POINT(NAME, IMPL, ELEMENT, F16)                                                                 \
    int NAME(const float *q, const ELEMENT *k_cache, const ELEMENT *v_cache, int64_t num_blocks, const int64_t *table, \
             int width, int64_t start, int n, float *out, int heads, int kv_heads, int dim, int block_size,           \
             float scale, int threads) {                                                                              \
        return IMPL(q, k_cache, v_cache, num_blocks, table, width, start, n, out, heads, kv_heads, dim, block_size,   \
                    scale, threads, F16);                                                                             \
    }
#define PREFILL_ENTRY_POINTS(NAME, IMPL)               \
    PREFILL_ENTRY_POINT(NAME##_f16, IMPL, uint16_t, 1) \
    PREFILL_ENTRY_POINT(NAME##_f32, IMPL, float, 0)

#endif
