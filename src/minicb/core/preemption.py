"""Preemption: when KV blocks run out, which running sequence gives its memory back, and how.

Blocks grow as sequences decode, so a step can find a running sequence that needs a new block while
the pool is empty. Then a *victim* is suspended until the sequence fits (the victim may be the
sequence itself, which then simply waits).

Which victim::

    running, most important first                          victim = the last one
    fcfs     : by admitted_index (admission order)  A0 B1 C2 D3   -> D3, the newest admission
    priority : by (priority, arrival_index)         A(0) C(0) B(1) D(2)  -> D, the least important

Because the most important running sequence is never chosen while another one is left, it always
makes progress: two sequences cannot preempt each other forever (liveness).

How (the mode)::

    recompute : free its blocks and slot, num_computed_tokens = 0, status WAITING; the scheduler puts
                it at the FRONT of the waiting queue. It later re-prefills prompt + generated tokens,
                which yields exactly the next token it would have produced.
    swap      : copy its blocks to the host pool (status SWAPPED, slot released); it comes back with
                swap_in before any new request is admitted. When the host pool cannot hold it, or it
                shares a prefix-cached block with another request (a shared block is never swapped
                out), fall back to recompute: with prefix caching its shared prefix stays resident
                and is found again at re-admission, so only its private tail is recomputed.

Either way ``Sequence.num_preemptions`` counts it. This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from minicb.core.block_manager import BlockManager
from minicb.core.errors import InvalidArgument
from minicb.core.sequence import Sequence, SequenceStatus
from minicb.core.slot_table import SlotTable


def importance_key(seq: Sequence, scheduling_policy: str, num_arrivals: int = 0,
                   aging: int = 0) -> tuple[int, ...]:
    """Sort key: smaller = more important = scheduled earlier and preempted last.

    ``priority`` with ``aging > 0``: a request gains one level for every ``aging`` requests that
    arrived after it (``num_arrivals`` is how many have arrived so far), so a stream of important
    requests cannot starve it forever; ``aging == 0`` is strict priority."""
    if scheduling_policy == "fcfs":
        return (seq.admitted_index, seq.arrival_index)
    if scheduling_policy == "priority":
        bonus = (num_arrivals - 1 - seq.arrival_index) // aging if aging else 0
        return (seq.priority - bonus, seq.arrival_index)
    raise InvalidArgument(f"scheduling_policy must be 'fcfs' or 'priority', got {scheduling_policy!r}")


def running_order(seqs: Iterable[Sequence], scheduling_policy: str, num_arrivals: int = 0,
                  aging: int = 0) -> list[Sequence]:
    """Running sequences, most important first: the order in which they get the step's budget."""
    return sorted(seqs, key=lambda s: importance_key(s, scheduling_policy, num_arrivals, aging))


def choose_victim(candidates: Iterable[Sequence], scheduling_policy: str, num_arrivals: int = 0,
                  aging: int = 0) -> Sequence:
    """The least important candidate: the newest admission (fcfs) or largest priority value."""
    return max(candidates, key=lambda s: importance_key(s, scheduling_policy, num_arrivals, aging))


@dataclass(slots=True, frozen=True)
class Preemption:
    """What one preemption did: the mode used and, for swap, the (device, host) block copies."""

    request_id: str
    mode: str                                   # "recompute" or "swap"
    swap_out: tuple[tuple[int, int], ...] = ()
    num_lost_tokens: int = 0                    # computed tokens recompute throws away


def preempt(seq: Sequence, mode: str, blocks: BlockManager, slots: SlotTable) -> Preemption:
    """Suspend the running ``seq``: release its slot, then swap or drop its blocks (see module doc).

    The caller puts it into the right queue (waiting front for recompute, swapped for swap).
    """
    if seq.status is not SequenceStatus.RUNNING or seq.slot_id is None:
        raise InvalidArgument(f"only a running sequence can be preempted, {seq.request_id!r} is "
                              f"{seq.status.value}")
    slots.release(seq.slot_id)
    seq.slot_id = None
    seq.num_preemptions += 1
    if mode == "swap" and blocks.can_swap_out(seq.request_id):
        seq.status = SequenceStatus.SWAPPED
        return Preemption(seq.request_id, "swap", tuple(blocks.swap_out(seq.request_id)))
    return _recompute(seq, blocks)


def _recompute(seq: Sequence, blocks: BlockManager) -> Preemption:
    blocks.free(seq.request_id)
    lost, seq.num_computed_tokens = seq.num_computed_tokens, 0
    seq.num_cached_tokens = 0                  # set again by the next admission's prefix-cache lookup
    seq.status = SequenceStatus.WAITING
    return Preemption(seq.request_id, "recompute", num_lost_tokens=lost)


def drop_swapped(seq: Sequence, blocks: BlockManager) -> Preemption:
    """Turn a swapped sequence into a recompute one (its host copy is no longer trusted)."""
    return _recompute(seq, blocks)
