/* A step's work as one queue of numbered items, taken by whichever thread of an OpenMP team is free,
 * in place of a barrier between its parts.
 *
 * Why not a barrier: a barrier waits for every thread to *arrive*, so when the OS takes a thread's
 * core for a few milliseconds (another process, the server's event loop, a client on the same
 * machine), the others wait for it at the next barrier, and layer_stack.c meets at nine a layer. Two
 * threads then lost to one on a busy machine (bench/RESULTS.md, issue 47). Here a part's completion
 * is counted in *items*, not threads: a thread that is not running holds up nobody unless it holds an
 * item, and the running thread takes the items it has not taken. (Spinning barriers, as OpenMP's are
 * unless OMP_WAIT_POLICY is set before libgomp loads, were worse still: the waiting thread held the
 * core the late one needed.)
 *
 * The numbering: every thread walks the same sequence of parts ("phases") with the same item counts,
 * so all agree that phase k holds the items [start_k, start_k + n_k). A thread takes the next number
 * with one fetch-and-add (`team_take`); before running an item of phase k it waits until `done`
 * reaches start_k (every item of the earlier phases finished: what this part reads was written), and
 * after it adds one to `done` (`team_finish`). A thread that took a number of a later phase carries it
 * there; one that was away and finds its number past a phase skips the phase.
 *
 * Waiting spins up to a budget of `pause` rounds, then sleeps on a futex (Linux; elsewhere it yields)
 * until the item that completes a phase wakes the sleepers. The budget adapts: a wait that ended in
 * sleep takes a quarter off it (down to TEAM_SPIN_MIN), one that ended while spinning adds
 * TEAM_SPIN_MIN (up to TEAM_SPIN_MAX, longer than the waits of a step on an idle machine). On an idle
 * machine it stays near the top; on a busy one it falls, and waiting threads give their cores up.
 * (Halving it instead let the odd long wait of an idle float32 step pull it down too far; a fixed
 * TEAM_SPIN_MAX spun too long on a busy machine.)
 *
 * The floor is the classic rule for spinning before blocking: spin at least about as long as going to
 * sleep and being woken costs, since a wait shorter than that is lost twice when it sleeps. On a KVM
 * guest a futex wake reaches a sleeping thread in tens of microseconds (a halted virtual CPU must be
 * woken), the order of 1024 pauses on Zen 4. The floor was 64 pauses: beside a server's client, whose
 * bursts pulled every thread's budget down to it, most of a phase's ordinary waits, a fraction of an
 * item long, ended in a sleep and a wake, and a served step took longer than the same step offline.
 * `bench/decode_floor.py --stack-builds "min64=-DTEAM_SPIN_MIN=64,min1k=" --beside 2,1` times both.
 *
 * Memory order: `done` is added to with release and read with acquire, so what an item wrote is seen
 * by every item of a later phase. `done` and `sleepers` are sequentially consistent with each other:
 * either the finishing thread sees a sleeper and wakes it, or the sleeper sees the new `done`.
 */
#ifndef MINICB_TEAM_QUEUE_H
#define MINICB_TEAM_QUEUE_H
#include <limits.h>
#include <stdint.h>
#include <sched.h>
#include <stdatomic.h>

#include "omp_id.h"
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
#define TEAM_SPIN_MIN 1024
#endif
#ifndef TEAM_DECAY
#define TEAM_DECAY 2        /* a wait that ended in sleep takes budget >> TEAM_DECAY off the budget */
#endif

static _Thread_local int team_spin = TEAM_SPIN_MAX;    /* this thread's budget (the pool's threads last) */

typedef struct {
    atomic_int taken, done, sleepers;
} team_queue_t;

/* the next item's number, for the calling thread */
static inline int team_take(team_queue_t *q) {
    return atomic_fetch_add_explicit(&q->taken, 1, memory_order_relaxed);
}

/* wait until `target` items are done (every item of the phases before the one starting at `target`) */
static inline void team_wait_done(team_queue_t *q, int target) {
    if (atomic_load_explicit(&q->done, memory_order_acquire) >= target) return;
    for (int i = 0; i < team_spin; ++i) {
        if (atomic_load_explicit(&q->done, memory_order_acquire) >= target) {
            team_spin = team_spin + TEAM_SPIN_MIN < TEAM_SPIN_MAX ? team_spin + TEAM_SPIN_MIN : TEAM_SPIN_MAX;
            return;
        }
        TEAM_PAUSE();
    }
    team_spin -= team_spin >> TEAM_DECAY;
    team_spin = team_spin > TEAM_SPIN_MIN ? team_spin : TEAM_SPIN_MIN;
    atomic_fetch_add(&q->sleepers, 1);
    for (int d; (d = atomic_load(&q->done)) < target;) {
#if defined(__linux__)
        syscall(SYS_futex, (int *)&q->done, FUTEX_WAIT_PRIVATE, d, NULL, NULL, 0);   /* at once if done moved */
#else
        (void)d;
        sched_yield();
#endif
    }
    atomic_fetch_sub_explicit(&q->sleepers, 1, memory_order_acq_rel);
}

/* one item of the phase that ends at `end` is finished; the one that completes the phase wakes sleepers */
static inline void team_finish(team_queue_t *q, int end) {
    if (atomic_fetch_add(&q->done, 1) + 1 == end && atomic_load(&q->sleepers)) {
#if defined(__linux__)
        syscall(SYS_futex, (int *)&q->done, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#endif
    }
}

#ifdef TEAM_BARRIERS
/* The rule before the queue, for side-by-side timing (`bench/decode_floor.py --stack-builds`): thread t
 * runs items t, t + nt, ... of the phase, then waits for all of them, a barrier's wait. */
#define TEAM_PHASE(q, base, mine, count, ...)                                      \
    do {                                                                           \
        const int phase_end_ = (base) + (int)(count);                              \
        (void)(mine);                                                              \
        (base) = phase_end_;                                                       \
        for (int64_t item = omp_thread(); item < (int64_t)(count); item += omp_threads()) { \
            __VA_ARGS__                                                            \
            team_finish((q), phase_end_);                                          \
        }                                                                          \
        team_wait_done((q), phase_end_);                                           \
    } while (0)
#else
/* A phase of `count` items in a thread's walk: runs the body (the last argument; `item` is its number in
 * the phase) for every item this thread takes, each once the earlier phases are done. `base` (the phase's first number, the
 * same in every thread) and `mine` (the number this thread holds) are the caller's. */
#define TEAM_PHASE(q, base, mine, count, ...)                                       \
    do {                                                                           \
        const int phase_start_ = (base), phase_end_ = (base) + (int)(count);       \
        (base) = phase_end_;                                                       \
        while ((mine) < phase_end_) {                                              \
            team_wait_done((q), phase_start_);                                     \
            {                                                                      \
                const int64_t item = (mine) - phase_start_;                        \
                __VA_ARGS__                                                        \
            }                                                                      \
            team_finish((q), phase_end_);                                          \
            (mine) = team_take(q);                                                 \
        }                                                                          \
    } while (0)
#endif
#endif
