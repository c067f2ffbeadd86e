/* The calling thread's number in its OpenMP team and the team's size, 0 and 1 in a build without
 * OpenMP (ckernels.py builds a file without -fopenmp where the compiler rejects it). */
#ifndef MINICB_OMP_ID_H
#define MINICB_OMP_ID_H
#if defined(_OPENMP)
#include <omp.h>
static inline int omp_thread(void) { return omp_get_thread_num(); }
static inline int omp_threads(void) { return omp_get_num_threads(); }
#else
static inline int omp_thread(void) { return 0; }
static inline int omp_threads(void) { return 1; }
#endif

/* The statement (the arguments) run by a team of `num_threads` threads (a variable of that name in
 * scope), or by the calling thread alone when num_threads <= 1: not by a team of one, which `omp
 * parallel` opens even then. layer_stack.c calls the kernels for one thread from inside its own team,
 * for every few rows of every layer, where each such team is nested: a malloc and futex system calls. */
#define TEAM_OR_ALONE(...)                                                                             \
    if (num_threads > 1) {                                                                           \
        _Pragma("omp parallel num_threads(num_threads)") { __VA_ARGS__; }                            \
    } else {                                                                                         \
        __VA_ARGS__;                                                                                 \
    }
#endif
