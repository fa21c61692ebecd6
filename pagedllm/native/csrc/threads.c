/* threads.c: pins the OpenMP threads to CPUs (PAGEDLLM_CPU_OMP_THREADS_BIND=0-3, as vLLM's
 * VLLM_CPU_OMP_THREADS_BIND). torch and this library share one OpenMP runtime (both link
 * libgomp.so.1, so the loader maps one), hence one thread pool: a thread pinned here is the
 * thread torch's parallel regions and every kernel of this library run on. libgomp hands team
 * slot i to the same pool thread in every region of the same size, so the pinning holds. */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>

#include "pagedllm_native.h"

PN_EXPORT int pn_pin_threads(const int32_t *cpus, int n) {
    if (n < 1 || n > CPU_SETSIZE)
        return PN_ERR_ARG;
    for (int i = 0; i < n; i++)
        if (cpus[i] < 0 || cpus[i] >= CPU_SETSIZE)
            return PN_ERR_ARG;
    int pinned = 0;
#pragma omp parallel num_threads(n) reduction(+ : pinned)
    {
        const int tid = omp_get_thread_num();
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[tid], &set);
        pinned += sched_setaffinity(0, sizeof set, &set) == 0; /* 0: the calling thread */
    }
    return pinned == n ? 0 : PN_ERR_ARG;
}
