"""The scheduler's checks: a request before it is queued, and every invariant of its state.

Neither runs in a step: ``Scheduler.validate`` (and so ``add``) calls ``check_request`` once per
request, and the tests call ``Scheduler.check_integrity`` (``check_scheduler``) after every step of
their random workloads, so the scheduler's own code stays the loop a reader follows. The invariants
are those of the scheduler's module docstring. This module imports no torch.
"""

from __future__ import annotations

from minicb.core.block_manager import BlockManager
from minicb.core.config import SchedulerConfig
from minicb.core.errors import InvalidArgument, RequestRejected
from minicb.core.sequence import Sequence, SequenceStatus


def check_request(seq: Sequence, forks, config: SchedulerConfig, blocks: BlockManager,
                  in_use: set[str]) -> None:
    """Raise (``InvalidArgument``, or ``RequestRejected`` for a request that can never be served) if
    ``seq`` with its ``forks`` may not be queued; ``in_use``: the ids of unfinished requests."""
    _check_one(seq, config, blocks, in_use)
    if 1 + len(forks) > config.max_n:
        raise RequestRejected(f"request {seq.request_id!r} asks for n={1 + len(forks)} parallel samples, "
                              f"more than max_n={config.max_n}")
    ids = {seq.request_id}
    for child in forks:
        _check_one(child, config, blocks, in_use)
        if child.request_id in ids:
            raise InvalidArgument(f"request_id {child.request_id!r} is given twice")
        ids.add(child.request_id)
        if child.prompt_token_ids != seq.prompt_token_ids:
            raise InvalidArgument(f"child {child.request_id!r} must have the prompt of {seq.request_id!r}")


def _check_one(seq: Sequence, c: SchedulerConfig, blocks: BlockManager, in_use: set[str]) -> None:
    if not isinstance(seq, Sequence):
        raise InvalidArgument(f"seq must be a Sequence, got {type(seq).__name__}")
    rid = seq.request_id
    if not isinstance(rid, str):
        raise InvalidArgument(f"request_id must be a str, got {type(rid).__name__}")
    if rid in in_use:
        raise InvalidArgument(f"request_id {rid!r} is already in use by an unfinished request")
    if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.output_token_ids:
        raise InvalidArgument(f"request {rid!r} must be a fresh sequence (WAITING, nothing computed)")
    total = seq.max_total_tokens
    if not seq.prompt_token_ids:
        raise RequestRejected(f"request {rid!r} has an empty prompt (need at least 1 token)")
    if total > c.max_model_len:
        raise RequestRejected(
            f"request {rid!r}: prompt ({seq.num_prompt_tokens}) + max_tokens ({seq.params.max_tokens})"
            f" = {total} tokens exceeds max_model_len={c.max_model_len}")
    need = blocks.blocks_needed(total)
    if need > c.num_blocks:
        raise RequestRejected(
            f"request {rid!r} needs {need} KV blocks of {c.block_size} tokens for {total} tokens "
            f"(prompt + max_tokens), but the whole pool has num_blocks={c.num_blocks}")


def check_scheduler(sched, seqs: dict[str, Sequence], attached: dict[str, list[Sequence]]) -> None:
    """Every invariant of the scheduler's state (its module docstring); ``AssertionError`` naming the
    request that breaks one. ``seqs``: every unfinished request; ``attached``: child 0 -> children."""
    sched.slot_table.check_integrity()
    sched.block_manager.check_integrity()
    waiting, swapped, running = list(sched.waiting), list(sched.swapped), list(sched.running.values())
    children = [c for cs in attached.values() for c in cs]
    ids = [s.request_id for s in waiting + swapped + running + children]
    assert len(ids) == len(set(ids)) and set(ids) == set(seqs), \
        "every unfinished request must be in exactly one of waiting / swapped / running / attached"
    bm = sched.block_manager
    for seq in waiting + children:
        assert seq.status is SequenceStatus.WAITING and seq.slot_id is None, seq.request_id
        assert seq.num_computed_tokens == 0, f"{seq.request_id} waits with computed tokens"
        assert seq.num_cached_tokens == 0, f"{seq.request_id} waits with cached tokens"
        assert seq.request_id not in bm.block_tables and not bm.is_swapped(seq.request_id), seq.request_id
    for rid, cs in attached.items():          # attached children wait on a child 0 that sampled nothing
        parent = seqs.get(rid)
        assert parent is not None and not parent.output_token_ids, \
            f"{rid}: children still attached after the fork"
        assert sched.config.policy == "continuous", "the padded policies never fork"
        for c in cs:
            assert not c.output_token_ids and c.prompt_token_ids == parent.prompt_token_ids, c.request_id
    for seq in swapped:
        assert seq.status is SequenceStatus.SWAPPED and seq.slot_id is None, seq.request_id
        assert bm.is_swapped(seq.request_id), f"{seq.request_id} is swapped without a host table"
        assert len(bm.host_tables[seq.request_id]) * bm.block_size >= seq.num_computed_tokens
        assert 0 <= seq.num_computed_tokens < seq.num_tokens, seq.request_id
    for seq in running:
        _check_running(sched, seq)
    holders = {s.request_id for s in running} | {s.request_id for s in sched.policy.batch}
    assert set(sched.slot_table.held().values()) == holders, "slot holders != running requests"
    assert set(bm.block_tables) == holders, "device tables != running requests"
    assert set(bm.host_tables) == {s.request_id for s in swapped}
    assert len(holders) <= sched.config.max_num_seqs
    _check_shared_blocks(bm, running)
    sched.policy.check_integrity()


def _check_running(sched, seq: Sequence) -> None:
    bm = sched.block_manager
    assert seq.status is SequenceStatus.RUNNING, seq.request_id
    assert sched.slot_table.owner(seq.slot_id) == seq.request_id, f"{seq.request_id}: slot mismatch"
    assert seq.request_id in bm.block_tables, f"{seq.request_id} runs without a device table"
    assert len(bm.block_tables[seq.request_id]) * bm.block_size >= seq.num_computed_tokens
    assert 0 <= seq.num_computed_tokens < seq.num_tokens, seq.request_id
    assert 0 <= seq.num_cached_tokens <= seq.num_computed_tokens, seq.request_id
    for i, block in enumerate(bm.block_tables[seq.request_id]):
        if not bm.is_cached(block):
            break                             # cached blocks are a prefix of the table, and ...
        assert (i + 1) * bm.block_size <= seq.num_computed_tokens, \
            f"{seq.request_id}: cached block {block} would still be written"   # ... never written


def _check_shared_blocks(bm: BlockManager, running: list[Sequence]) -> None:
    """Copy-on-write leaves no block written by two sequences: a block that several tables name is,
    for each of its holders, either full of computed K/V or the holder's partly filled last block,
    which the holder copies before it writes (``BlockManager.append_slots``)."""
    bs = bm.block_size
    for seq in running:
        table = bm.block_tables[seq.request_id]
        for i, block in enumerate(table):
            if bm.device.ref_counts[block] > 1 and (i + 1) * bs > seq.num_computed_tokens:
                assert i == len(table) - 1 and i * bs <= seq.num_computed_tokens, \
                    f"{seq.request_id}: shared block {block} (ref {bm.device.ref_counts[block]}) " \
                    "would be written without a copy"

