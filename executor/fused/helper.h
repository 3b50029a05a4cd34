/* The decode helper: a second thread that takes chunks of a fused decode step's products and attention while the
 * step's own thread (the lane thread) takes the others, with no barrier between them (helper.c). */
#ifndef AGENTSERVE_FUSED_HELPER_H
#define AGENTSERVE_FUSED_HELPER_H

#include <stdint.h>

enum { JOB_PRODUCT = 1, JOB_ATTENTION = 2 };
#define HELPER_MAX_CHUNKS 32

/* One shareable piece of a step: a product (chunk c: rows [c * chunk_rows, ...) of every sequence) or the attention
 * of a batch (chunk c: sequence c, or for a single sequence its KV heads [c * kv_per_chunk, ...)).  Everything it
 * points at outlives the helper's use of it (the model, the cache, the helper's own scratch and tables; DecodeHelper
 * holds the fused step until closed), so a helper that computes a chunk of a job the lane thread has left behind
 * reads stale numbers, never freed memory; what it computed is then dropped. */
typedef struct {
    int kind, chunks, batch, width;
    int kv_per_chunk;          /* attention: KV heads a chunk attends (all of them: a chunk is a sequence) */
    int64_t chunk_rows;
    uint64_t step;             /* set by helper_share: the lane thread's step the job belongs to */
    const void *mat;           /* product: its Mat */
    const void *model, *layer; /* attention: the Model and Layer */
    const float *x;            /* product: input [batch, cols]; attention: queries [batch, heads * dim] */
    float *y;                  /* output: product [batch, rows]; attention [batch, heads * dim] */
    const int64_t *tables, *lens;
} FusedJob;

/* Where chunk c of a job lands in its output: `segments` runs of `len` floats, `stride` apart, from `offset`. */
typedef struct {
    int64_t offset, len, stride;
    int segments;
} ChunkPlace;

typedef struct Helper Helper;

/* decode_step.c: chunk c of a job computed into out (its runs `ld` floats apart), and where it lands. */
int fused_run_chunk(const FusedJob *job, int c, float *out, int64_t ld);
ChunkPlace fused_chunk_place(const FusedJob *job, int c);

/* helper.c, for decode_step.c */
int helper_share(Helper *h, FusedJob *job); /* 0: every chunk written; else a chunk's error (chunks <= HELPER_MAX_CHUNKS) */
int helper_step_begin(Helper *h, int batch, int width, const int64_t *tables, const int64_t *lens,
                      const int64_t **tables_out, const int64_t **lens_out, float **scratch);
void helper_step_end(Helper *h);

#endif
