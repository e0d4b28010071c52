/* Pins each OpenMP thread of the calling thread's team to one core, as vLLM's CPU workers do:
 * thread i of a team of n runs on cores[i] only. Called from the thread that runs the model, so
 * the team it sets up is the one torch's parallel regions reuse from that thread.
 *
 * Built by kernels/cpu_build.py against the libgomp torch already loaded (one thread pool).
 */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>

/* Returns how many threads could not be pinned (0 on success). */
int bind_omp_threads(const int *cores, int n) {
  int failed = 0;
#pragma omp parallel num_threads(n) reduction(+ : failed)
  {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cores[omp_get_thread_num()], &set);
    failed += sched_setaffinity(0, sizeof(set), &set) != 0;
  }
  return failed;
}
