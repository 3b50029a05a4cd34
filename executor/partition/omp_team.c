/* The calling thread's OpenMP worker team, as the cpu-cores backend needs it (loaded through ctypes by
 * omp_team.py; built into the CPU library with the attention kernels).
 *
 * libgomp keeps one pool of worker threads per thread that starts parallel regions, shared by every library
 * that uses the same runtime: a lane thread's PyTorch products and these functions run on the same workers
 * when PyTorch's OpenMP runtime is the one this library was linked against (omp_team.py checks that first).
 * A worker keeps the affinity mask it was created with; agentserve_pin_team moves the first nthreads - 1
 * workers, with the calling thread, onto a new set of CPUs.  How libgomp's pool behaves makes that enough:
 * a region with fewer threads than the pool ends the surplus workers, a region with more creates the new
 * ones with the calling thread's mask as it is then, and a one-thread region leaves the pool alone, so a
 * worker parked by one-thread regions keeps its old mask until a larger team is pinned again (the caller
 * pins whenever the cores change or the thread count grows) or its pool is ended (agentserve_release_team). */
#define _GNU_SOURCE
#include <sched.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif
/* omp_pause_resource_all (OpenMP 5.0) is in omp.h from GCC 9 and clang 8, whose _OPENMP still says 4.5; a weak
 * reference, so a runtime without it (an older libgomp loaded first by PyTorch) leaves it NULL instead of failing
 * the library's load. */
#if defined(_OPENMP) && (_OPENMP >= 201811 || (!defined(__clang__) && __GNUC__ >= 9) || __clang_major__ >= 8)
#define HAVE_PAUSE 1
#pragma weak omp_pause_resource_all
#else
#define HAVE_PAUSE 0
#endif

/* The calling thread's nthreads ICV in this library's runtime (what torch.set_num_threads sets in its own). */
int agentserve_omp_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return -1;
#endif
}

/* Set the calling thread's nthreads ICV in this library's runtime (omp_team.py's check of the runtime). */
void agentserve_omp_set_num_threads(int n) {
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}

/* Pin the calling thread and the first nthreads - 1 workers of its team to cpus[0..ncpus-1]: with one_each, team
 * thread i to cpus[i % ncpus] alone (the calling thread to cpus[0]), else every one of them to the whole set.
 * Returns the number of team threads whose mask could not be set (0: all), or -1 without OpenMP. */
int agentserve_pin_team(int nthreads, const int *cpus, int ncpus, int one_each) {
#ifdef _OPENMP
    cpu_set_t all;
    CPU_ZERO(&all);
    for (int i = 0; i < ncpus; i++)
        if (cpus[i] >= 0 && cpus[i] < CPU_SETSIZE) CPU_SET(cpus[i], &all);
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : failed)
    {
        cpu_set_t set = all;
        int cpu = ncpus > 0 ? cpus[omp_get_thread_num() % ncpus] : -1;
        if (one_each && cpu >= 0 && cpu < CPU_SETSIZE) {
            CPU_ZERO(&set);
            CPU_SET(cpu, &set);
        }
        failed += sched_setaffinity(0, sizeof set, &set) != 0;
    }
    return failed;
#else
    (void)nthreads, (void)cpus, (void)ncpus, (void)one_each;
    return -1;
#endif
}

/* End the calling thread's pool of idle workers (libgomp: joined, no longer counted as managed threads); its next
 * parallel region of more than one thread creates new ones, with the calling thread's affinity mask as it is then.
 * libgomp shortens every worker's spin-wait to ~100 iterations whenever it manages more threads than there are
 * CPUs, counting every pool's idle workers: a thread's leftover pool slows every other thread's parallel regions.
 * Returns 0, or -1 inside a parallel region or without OpenMP 5.0's omp_pause_resource_all. */
int agentserve_release_team(void) {
#if HAVE_PAUSE
    return omp_pause_resource_all ? omp_pause_resource_all(omp_pause_soft) : -1;
#else
    return -1;
#endif
}

/* For tests: each of the team's threads (up to nthreads) writes its mask's first 64 CPUs to
 * out[omp_get_thread_num()]; returns how many threads the team had (-1 without OpenMP). */
int agentserve_team_masks(int nthreads, uint64_t *out) {
#ifdef _OPENMP
    int size = 0;
#pragma omp parallel num_threads(nthreads)
    {
        cpu_set_t set;
        uint64_t bits = 0;
        if (sched_getaffinity(0, sizeof set, &set) == 0)
            for (int c = 0; c < 64; c++)
                if (CPU_ISSET(c, &set)) bits |= (uint64_t)1 << c;
        out[omp_get_thread_num()] = bits;
#pragma omp single
        size = omp_get_num_threads();
    }
    return size;
#else
    (void)nthreads, (void)out;
    return -1;
#endif
}
