/* A barrier for the threads of one OpenMP team that spins while waits are short and sleeps when
 * they are not.
 *
 * Why not `#pragma omp barrier`: libgomp's waits spin for 300,000 rounds (its manual's GOMP_SPINCOUNT
 * default) before they sleep, unless OMP_WAIT_POLICY says otherwise when the library loads (before
 * minicb could set it). On a machine whose cores are busy with other work, a thread spinning at a
 * barrier holds a core that the thread it waits for needs; layer_stack.c meets at nine barriers a
 * layer, and a one-sequence decode on two threads of the busy 2-core VM took several times as long
 * as on one (bench/RESULTS.md, issue 47). Sleeping at once (OMP_WAIT_POLICY=PASSIVE) fixed that there,
 * and on an idle machine its futex wake-up at every barrier took most of what the second thread saves.
 *
 * So each thread spins up to its own budget of `pause` rounds, then sleeps on a futex until the last
 * thread arrives and wakes it (Linux; elsewhere it yields). The budget adapts: a wait that ended in
 * sleep takes a quarter off it (down to TEAM_SPIN_MIN), a wait that ended while spinning adds
 * TEAM_SPIN_MIN (up to TEAM_SPIN_MAX, chosen longer than the waits of a step on an idle machine). On
 * an idle machine it stays near the top; on a busy one it falls, and waiting threads give their cores
 * up. (Halving it instead let the odd long wait of an idle float32 step pull it down too far; a fixed
 * TEAM_SPIN_MAX spun too long on a busy machine.)
 *
 * Sense by generation: each arrival adds one to `count`; the last resets it and bumps `gen`, whose
 * change the others wait for. The atomics order the team's writes before the barrier ahead of its
 * reads after it, as an OpenMP barrier does.
 */
#ifndef MINICB_TEAM_BARRIER_H
#define MINICB_TEAM_BARRIER_H
#include <limits.h>
#include <sched.h>
#include <stdatomic.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TEAM_PAUSE() _mm_pause()
#else
#define TEAM_PAUSE() ((void)0)
#endif

#ifndef TEAM_SPIN_MAX
#define TEAM_SPIN_MAX 4096
#endif
#ifndef TEAM_SPIN_MIN
#define TEAM_SPIN_MIN 64
#endif
#ifndef TEAM_DECAY
#define TEAM_DECAY 2        /* a wait that ended in sleep takes budget >> TEAM_DECAY off the budget */
#endif

static _Thread_local int team_spin = TEAM_SPIN_MAX;    /* this thread's budget (the pool's threads last) */

typedef struct {
    atomic_int count, gen, sleepers;
} team_barrier_t;

static void team_wait(team_barrier_t *b, int nt) {
    if (nt <= 1) return;
    const int g = atomic_load_explicit(&b->gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->count, 1, memory_order_acq_rel) == nt - 1) {
        atomic_store_explicit(&b->count, 0, memory_order_relaxed);
        atomic_store(&b->gen, g + 1);             /* sequentially consistent with the sleepers' count: */
#if defined(__linux__)                          /* either it sees a sleeper or the sleeper sees gen */
        if (atomic_load(&b->sleepers))
            syscall(SYS_futex, (int *)&b->gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#endif
        return;
    }
    for (int i = 0; i < team_spin; ++i) {
        if (atomic_load_explicit(&b->gen, memory_order_acquire) != g) {
            team_spin = team_spin + TEAM_SPIN_MIN < TEAM_SPIN_MAX ? team_spin + TEAM_SPIN_MIN : TEAM_SPIN_MAX;
            return;
        }
        TEAM_PAUSE();
    }
    team_spin -= team_spin >> TEAM_DECAY;
    team_spin = team_spin > TEAM_SPIN_MIN ? team_spin : TEAM_SPIN_MIN;
    atomic_fetch_add(&b->sleepers, 1);
    while (atomic_load(&b->gen) == g) {
#if defined(__linux__)
        syscall(SYS_futex, (int *)&b->gen, FUTEX_WAIT_PRIVATE, g, NULL, NULL, 0);   /* returns at once if gen moved */
#else
        sched_yield();
#endif
    }
    atomic_fetch_sub_explicit(&b->sleepers, 1, memory_order_acq_rel);
}
#endif
