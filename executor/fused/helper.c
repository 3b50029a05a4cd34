/* The decode helper: a second thread that shares a fused decode step's products and attention with the step's own
 * thread (the lane thread) without a barrier.
 *
 * A decode step on one core is memory-bound and short (1-5 ms); on two it runs 1.5-1.8x faster, but an OpenMP team
 * waits at every product's barrier for its slowest thread, and on a small machine the other core is often taken
 * for a while by the orchestrator, a client or the prefill lane: one descheduled worker then stalls the whole step
 * for a scheduler time slice.  Here the lane thread never waits for the helper for longer than about two chunks:
 *
 * - the lane thread posts a job (a product or a batch's attention, cut into chunks) and takes chunks from the front;
 *   the helper, spinning while a step runs, takes them from the back and computes each into the chunk's own slot of
 *   its private buffer, then marks it ready (compare-and-swap); the lane thread copies ready chunks into the output;
 * - when the lane thread runs out of free chunks it waits for the helper's chunks for about two of its own chunk
 *   times, then takes back each one not yet ready (compare-and-swap) and computes it itself; a helper that finishes
 *   a chunk taken back finds the swap failed and drops its result.  The helper never writes the step's memory.
 *
 * Every chunk's state word carries its job's id, so a helper that was descheduled in the middle of a job the lane
 * thread has since finished can neither claim nor mark anything of it.  What it reads while computing a stale
 * chunk is memory that outlives it (helper.h); the block tables it reads are the helper's copies, two sets used
 * by alternate shared steps, and a step whose set the helper may still be reading (it is still in the step before
 * the previous one) runs without it.  No lane thread wait depends on the helper being scheduled again.
 * Results are bitwise those of one thread: a product's rows and a sequence's attention are computed by the same
 * code whichever thread runs them.
 *
 * The helper sleeps (futex) between steps and whenever its owner disallows it (the prefill lane running on its
 * core); the lane thread wakes it at each step it may help. */
#include "helper.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define PAUSE() ((void)0)
#endif

enum { FREE = 0, MINE = 1, HELPING = 2, READY = 3, TAKEN = 4 };
#define STATE(id, st) (((uint64_t)(id) << 3) | (st))
#define STATE_OF(word) ((int)((word) & 7))
#define SPIN_NS 50000      /* a helper with nothing to do spins this long before it sleeps */
#define MIN_GRACE_NS 4000  /* the lane thread waits at least this long for a helper's chunk */

struct Helper {
    _Atomic uint64_t seq; /* 2 * job id; odd while the lane thread writes the job */
    FusedJob job;
    _Atomic uint64_t state[HELPER_MAX_CHUNKS];
    _Atomic int active, allowed, stop, sleeping;
    _Atomic uint32_t wake;       /* futex word: bumped at each step and each change of `allowed` */
    _Atomic uint64_t inside;     /* the step the helper is computing a chunk of, 0 between chunks */
    uint64_t step;               /* the lane thread's step count (its own) */
    int max_batch, max_width;
    int64_t private_floats;
    float *scratch, *private;
    int64_t *tables[2], *lens[2];
    int stall_every, stall_us;   /* tests: the helper sleeps stall_us in every stall_every-th chunk it takes */
    _Atomic uint64_t helped, taken_back, steps; /* chunks the helper made ready; chunks taken back from it; steps */
};

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void futex_wait(_Atomic uint32_t *word, uint32_t seen) {
#if defined(__linux__)
    const struct timespec limit = {0, 20000000}; /* 20 ms: a missed wake costs at most this */
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, seen, &limit, NULL, 0);
#else
    (void)word, (void)seen;
    const struct timespec nap = {0, 100000};
    nanosleep(&nap, NULL);
#endif
}

static void wake_helper(Helper *h) {
    atomic_fetch_add(&h->wake, 1); /* sequentially consistent with the helper's `sleeping` then `wake` */
#if defined(__linux__)
    if (atomic_load(&h->sleeping))
        syscall(SYS_futex, (uint32_t *)&h->wake, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
#endif
}

void fused_helper_destroy(Helper *h);

/* A helper for steps of up to max_batch sequences with block tables up to max_width wide; scratch_floats: a step's
 * scratch at max_batch (fused_decode_scratch); private_floats: the largest chunk a job may give it (a slot that
 * size for each of a job's chunks).  NULL: no memory. */
Helper *fused_helper_create(int max_batch, int max_width, int64_t scratch_floats, int64_t private_floats) {
    Helper *h = calloc(1, sizeof(Helper));
    if (h == NULL) return NULL;
    h->max_batch = max_batch, h->max_width = max_width;
    h->private_floats = private_floats;
    h->scratch = malloc(sizeof(float) * (size_t)scratch_floats);
    h->private = malloc(sizeof(float) * (size_t)private_floats * HELPER_MAX_CHUNKS); /* a slot per chunk */
    int ok = h->scratch != NULL && h->private != NULL;
    for (int i = 0; i < 2; i++) {
        h->tables[i] = malloc(sizeof(int64_t) * (size_t)max_batch * (size_t)max_width);
        h->lens[i] = malloc(sizeof(int64_t) * (size_t)max_batch);
        ok = ok && h->tables[i] != NULL && h->lens[i] != NULL;
    }
    atomic_store(&h->allowed, 1);
    if (!ok) {
        fused_helper_destroy(h);
        return NULL;
    }
    return h;
}

/* Free a helper whose serving thread has returned (fused_helper_stop, then join it). */
void fused_helper_destroy(Helper *h) {
    if (h == NULL) return;
    free(h->scratch), free(h->private);
    for (int i = 0; i < 2; i++) free(h->tables[i]), free(h->lens[i]);
    free(h);
}

void fused_helper_stop(Helper *h) {
    atomic_store(&h->stop, 1);
    wake_helper(h);
}

/* The owner lets the helper take chunks (1) or not (0: it finishes the chunk it has, then sleeps). */
void fused_helper_allow(Helper *h, int allowed) {
    atomic_store(&h->allowed, allowed != 0);
    if (allowed) wake_helper(h);
}

/* Tests: make the helper sleep `us` microseconds inside every `every`-th chunk it takes (0: never). */
void fused_helper_stall(Helper *h, int every, int us) { h->stall_every = every, h->stall_us = us; }

/* counts[0..2]: chunks the helper wrote, chunks taken back from it, steps it was offered. */
void fused_helper_counts(const Helper *h, int64_t counts[3]) {
    counts[0] = (int64_t)atomic_load(&h->helped);
    counts[1] = (int64_t)atomic_load(&h->taken_back);
    counts[2] = (int64_t)atomic_load(&h->steps);
}

/* Lane thread, before a step: whether the helper can share it; if so the step runs on the helper's scratch and on
 * copies of its tables and lengths (their pointers returned). */
int helper_step_begin(Helper *h, int batch, int width, const int64_t *tables, const int64_t *lens,
                      const int64_t **tables_out, const int64_t **lens_out, float **scratch) {
    if (batch > h->max_batch || width > h->max_width || !atomic_load_explicit(&h->allowed, memory_order_relaxed))
        return 0;
    const uint64_t step = h->step + 1;
    /* the set this step writes was last used two shared steps ago: if the helper is still in that step (descheduled
     * in the middle of a chunk the lane thread took back), this step runs without it rather than wait */
    if (step > 2 && atomic_load(&h->inside) == step - 2) return 0;
    h->step = step;
    const int set = (int)(step & 1);
    memcpy(h->tables[set], tables, sizeof(int64_t) * (size_t)batch * (size_t)width);
    memcpy(h->lens[set], lens, sizeof(int64_t) * (size_t)batch);
    *tables_out = h->tables[set], *lens_out = h->lens[set], *scratch = h->scratch;
    atomic_fetch_add_explicit(&h->steps, 1, memory_order_relaxed);
    atomic_store_explicit(&h->active, 1, memory_order_release);
    wake_helper(h);
    return 1;
}

void helper_step_end(Helper *h) { atomic_store_explicit(&h->active, 0, memory_order_release); }

/* Lane thread: compute chunk c into its place in the job's output; a first error is kept in *failed. */
static void run_here(const FusedJob *job, int c, int *failed) {
    const ChunkPlace p = fused_chunk_place(job, c);
    const int rc = fused_run_chunk(job, c, job->y + p.offset, p.stride);
    if (*failed == 0) *failed = rc;
}

/* Lane thread: run a job, sharing its chunks with the helper; returns when every chunk is in its output. */
int helper_share(Helper *h, FusedJob *job) {
    if (job->chunks > HELPER_MAX_CHUNKS) return -6;
    job->step = h->step;
    const uint64_t id = atomic_load_explicit(&h->seq, memory_order_relaxed) / 2 + 1;
    atomic_store_explicit(&h->seq, 2 * id - 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    h->job = *job;
    const int chunks = job->chunks;
    for (int c = 0; c < chunks; c++) atomic_store_explicit(&h->state[c], STATE(id, FREE), memory_order_relaxed);
    atomic_store_explicit(&h->seq, 2 * id, memory_order_release);

    const uint64_t start = now_ns();
    int mine = 0, failed = 0; /* a failed chunk's error is returned once no chunk is in the helper's hands */
    for (int c = 0; c < chunks; c++) { /* the front, while chunks are free */
        uint64_t free_word = STATE(id, FREE);
        if (!atomic_compare_exchange_strong(&h->state[c], &free_word, STATE(id, MINE))) break;
        run_here(job, c, &failed);
        mine++;
    }
    const uint64_t ended = now_ns(), per_chunk = mine ? (ended - start) / (uint64_t)mine : 0;
    const uint64_t deadline = ended + (2 * per_chunk > MIN_GRACE_NS ? 2 * per_chunk : MIN_GRACE_NS);
    for (int c = 0; c < chunks; c++) { /* the helper's chunks: wait for them, or take them back */
        for (;;) {
            uint64_t word = atomic_load_explicit(&h->state[c], memory_order_acquire);
            const int st = STATE_OF(word);
            if (st == MINE || st == TAKEN) break;
            if (st == READY) { /* the helper's result, in chunk c's slot: it no longer touches that slot in this job */
                const ChunkPlace p = fused_chunk_place(job, c);
                const float *slot = h->private + (int64_t)c * h->private_floats;
                for (int s = 0; s < p.segments; s++)
                    memcpy(job->y + p.offset + s * p.stride, slot + s * p.len, sizeof(float) * (size_t)p.len);
                break;
            }
            if (st == FREE || (st == HELPING && now_ns() >= deadline)) {
                if (!atomic_compare_exchange_strong(&h->state[c], &word, STATE(id, TAKEN))) continue;
                if (st == HELPING) atomic_fetch_add_explicit(&h->taken_back, 1, memory_order_relaxed);
                run_here(job, c, &failed);
                break;
            }
            PAUSE(); /* HELPING within the grace */
        }
    }
    return failed;
}

/* Take and compute chunks of the current job from the back while the lane thread works from the front. */
static void help_with_job(Helper *h, uint64_t id, const FusedJob *job) {
    for (int c = job->chunks - 1; c >= 0; c--) {
        if (!atomic_load_explicit(&h->allowed, memory_order_relaxed)) return;
        /* taken, or the job is over: stop before reading its descriptors again */
        if (atomic_load_explicit(&h->state[c], memory_order_relaxed) != STATE(id, FREE)) return;
        const ChunkPlace p = fused_chunk_place(job, c);
        if ((int64_t)p.segments * p.len > h->private_floats) return;
        /* inside before the claim (both sequentially consistent): once the claim holds, the lane thread cannot
         * start the step after next without seeing that the helper is still in this one */
        atomic_store(&h->inside, job->step);
        uint64_t free_word = STATE(id, FREE);
        if (!atomic_compare_exchange_strong(&h->state[c], &free_word, STATE(id, HELPING))) {
            atomic_store(&h->inside, 0);
            return;
        }
        const int rc = fused_run_chunk(job, c, h->private + (int64_t)c * h->private_floats, p.len);
        if (h->stall_every > 0 && (atomic_load_explicit(&h->helped, memory_order_relaxed) +
                                   atomic_load_explicit(&h->taken_back, memory_order_relaxed)) %
                                          (uint64_t)h->stall_every == 0) {
            const struct timespec nap = {0, 1000L * h->stall_us};
            nanosleep(&nap, NULL);
        }
        uint64_t helping = STATE(id, HELPING);
        if (rc == 0 && atomic_compare_exchange_strong(&h->state[c], &helping, STATE(id, READY)))
            atomic_fetch_add_explicit(&h->helped, 1, memory_order_relaxed);
        atomic_store_explicit(&h->inside, 0, memory_order_release);
        if (rc != 0) return; /* left HELPING: the lane thread takes it back and reports the error */
    }
}

/* The helper thread's body (called from a thread the owner pinned): serves steps until fused_helper_stop. */
void fused_helper_serve(Helper *h) {
    uint64_t done = 0, idle_since = 0;
    while (!atomic_load_explicit(&h->stop, memory_order_acquire)) {
        const uint32_t woken = atomic_load_explicit(&h->wake, memory_order_acquire);
        if (!atomic_load_explicit(&h->active, memory_order_acquire) ||
            !atomic_load_explicit(&h->allowed, memory_order_acquire)) {
            const uint64_t t = now_ns();
            if (idle_since == 0) idle_since = t;
            if (t - idle_since < SPIN_NS) {
                PAUSE();
                continue;
            }
            atomic_store_explicit(&h->sleeping, 1, memory_order_seq_cst);
            if (atomic_load_explicit(&h->wake, memory_order_seq_cst) == woken) futex_wait(&h->wake, woken);
            atomic_store_explicit(&h->sleeping, 0, memory_order_relaxed);
            idle_since = 0;
            continue;
        }
        idle_since = 0;
        const uint64_t seq = atomic_load_explicit(&h->seq, memory_order_acquire);
        if ((seq & 1) || seq / 2 == done) {
            PAUSE();
            continue;
        }
        FusedJob job;
        memcpy(&job, (const void *)&h->job, sizeof(job));
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load_explicit(&h->seq, memory_order_relaxed) != seq) continue; /* rewritten while copied */
        help_with_job(h, seq / 2, &job);
        done = seq / 2;
    }
}
