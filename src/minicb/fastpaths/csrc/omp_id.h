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
#endif
