"""Checker of exercise 9 (pack.py): the ragged packer.

    python -m pytest tutorials/exercises/check_pack.py --solution my_pack.py

Field by field on small plans first, then random plans against minicb's
packer, then a tiny model run by a real engine on your lists (their tokens
must equal a padded batch's).
"""

import random

import _reference
import pytest
from _checking import pick

from minicb.core.plan import ScheduledSeq, StepPlan


@pytest.fixture
def pack(solution):
    packer = pick(solution, "pack", _reference.pack)

    def checked(plan):
        got = packer(plan)
        if not isinstance(got, dict):
            pytest.fail(f"pack returned {type(got).__name__}: return a dict")
        missing = [f for f in _reference.FIELDS if f not in got]
        if missing:
            pytest.fail(f"pack's dict has no {missing}")
        return {k: list(got[k]) for k in _reference.FIELDS}
    return checked


def row(rid, start, n, table, sample=True, forks=(), first=5):
    return ScheduledSeq(rid, 0, tuple(range(first, first + n)), start,
                        tuple(table), sample, tuple(forks))


# the packer's docstring example: a 3-token prompt a, a decode b (9 tokens
# cached), a 2-token chunk c (4 cached) that does not reach its last token
EXAMPLE = StepPlan(0, (row("a", 0, 3, [2]), row("b", 9, 1, [0, 3, 5], 1),
                       row("c", 4, 2, [1, 4], False)), block_size=4)


def test_one_prompt(pack):
    got = pack(StepPlan(0, (row("a", 0, 5, [3, 1]),), block_size=4))
    want = {"input_ids": [5, 6, 7, 8, 9], "positions": [0, 1, 2, 3, 4],
            "slot_mapping": [12, 13, 14, 15, 4], "cu_seqlens_q": [0, 5],
            "context_lens": [5], "cu_seqlens_k": [0, 5],
            "block_tables": [[3, 1]], "logits_indices": [4],
            "sample_request_ids": ["a"]}
    for name, value in want.items():
        assert got[name] == value, (
            f"one 5-token prompt in blocks [3, 1] of 4: {name} is {value}, "
            f"you packed {got[name]}")


def test_positions_start_where_the_cache_ends(pack):
    got = pack(EXAMPLE)["positions"]
    assert got == [0, 1, 2, 9, 4, 5], (
        f"positions {got}: b has 9 tokens in the cache, so its new token is "
        "at position 9, and c's two at 4 and 5: start from each row's "
        "start_pos (RoPE rotates by the position in the request)")


def test_slots_go_through_the_block_table(pack):
    got = pack(EXAMPLE)["slot_mapping"]
    assert got == [8, 9, 10, 21, 16, 17], (
        f"slot_mapping {got}: position p of a row lives in its block "
        "table[p // 4] at offset p % 4: a's 0..2 in block 2 (8, 9, 10), b's "
        "9 in block 5 (21), c's 4, 5 in block 4 (16, 17)")


def test_keys_count_the_cached_context(pack):
    got = pack(EXAMPLE)
    assert got["cu_seqlens_q"] == [0, 3, 4, 6], \
        f"cu_seqlens_q {got['cu_seqlens_q']}: rows of 3, 1, 2 new tokens"
    assert got["context_lens"] == [3, 10, 6] and \
        got["cu_seqlens_k"] == [0, 3, 13, 19], (
        f"context_lens {got['context_lens']}, cu_seqlens_k "
        f"{got['cu_seqlens_k']}: a row's queries attend over its cached "
        "tokens AND its new ones (start_pos + new: 3, 10, 6), so the keys "
        "run 0, 3, 13, 19")


def test_block_tables_are_padded_with_zeros(pack):
    got = pack(EXAMPLE)["block_tables"]
    assert got == [[2, 0, 0], [0, 3, 5], [1, 4, 0]], (
        f"block_tables {got}: one row per sequence, each padded with 0 to "
        "the longest (3 blocks)")


def test_only_sampling_rows_get_logits(pack):
    got = pack(EXAMPLE)
    assert got["logits_indices"] == [2, 3], (
        f"logits_indices {got['logits_indices']}: a and b sample, from "
        "their last rows (2 and 3); c's chunk does not reach its last token, "
        "so it samples nothing and needs no logits")
    assert got["sample_request_ids"] == ["a", "b"], \
        f"sample_request_ids {got['sample_request_ids']}: ['a', 'b']"


def test_a_forks_children_sample_from_the_same_row(pack):
    plan = StepPlan(0, (row("a", 0, 3, [0], forks=("1_a", "2_a")),
                        row("b", 4, 1, [1, 2])), block_size=4)
    got = pack(plan)
    assert got["logits_indices"] == [2, 2, 2, 3] and \
        got["sample_request_ids"] == ["a", "1_a", "2_a", "b"], (
        f"logits_indices {got['logits_indices']}, sample_request_ids "
        f"{got['sample_request_ids']}: a's two children draw from a's last "
        "row too, each once: [2, 2, 2, 3], ['a', '1_a', '2_a', 'b']")


def test_padding_rows_write_nothing(pack):
    plan = StepPlan(0, (row("a", 0, 2, [1]),), padding=(3,), block_size=4)
    got = pack(plan)
    want = {"input_ids": [5, 6, 0, 0, 0], "positions": [0, 1, 0, 1, 2],
            "slot_mapping": [4, 5, -1, -1, -1], "cu_seqlens_q": [0, 2, 5],
            "context_lens": [2, 3], "cu_seqlens_k": [0, 2, 5],
            "block_tables": [[1], [0]], "logits_indices": [1]}
    for name, value in want.items():
        assert got[name] == value, (
            f"a 2-token prompt and a padding row of 3: {name} is {value}, "
            f"you packed {got[name]} (padding: token 0 at positions 0.., "
            "slot -1, an empty table, never sampled)")


def random_plan(rng, bs=4):
    seqs = []
    for i in range(rng.randint(1, 5)):
        start, n = rng.choice((0, rng.randint(1, 20))), rng.randint(1, 9)
        nblocks = -(-(start + n) // bs)
        table = rng.sample(range(64), nblocks)
        seqs.append(row(f"r{i}", start, n, table, rng.random() < 0.7,
                        (f"1_r{i}",) if rng.random() < 0.1 else (),
                        first=rng.randint(4, 50)))
    pad = tuple(rng.randint(1, 4) for _ in range(rng.choice((0, 0, 2))))
    return StepPlan(0, tuple(seqs), padding=pad, block_size=bs)


def test_random_plans_pack_as_minicb_does(pack):
    for seed in range(200):
        plan = random_plan(random.Random(seed))
        want, got = _reference.pack(plan), pack(plan)
        for name in _reference.FIELDS:
            assert got[name] == want[name], (
                f"random plan {seed}, rows (id, start_pos, new tokens, "
                f"table, sample): "
                f"{[(s.request_id, s.start_pos, len(s.token_ids), s.block_table, s.sample) for s in plan.seqs]}"  # noqa: E501
                f", padding {list(plan.padding)}: {name} is {want[name]}, "
                f"you packed {got[name]}")


def batches(packer):
    """The runner's ``pack`` made of yours: your lists as a ``RaggedBatch``,
    nothing recomputed."""
    import torch

    from minicb.model.attention import AttentionMetadata
    from minicb.runtime.packer import RaggedBatch

    def to_batch(plan, device="cpu", pad_token_id=0):
        v = packer(plan)
        cu_q, ctx = list(v["cu_seqlens_q"]), list(v["context_lens"])
        q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
        starts = [c - q for c, q in zip(ctx, q_lens)]

        def t(x, dtype):
            return torch.tensor(list(x), dtype=dtype, device=device)
        meta = AttentionMetadata(
            cu_seqlens_q=t(cu_q, torch.int32),
            cu_seqlens_k=t(v["cu_seqlens_k"], torch.int32),
            max_seqlen_q=max(q_lens, default=0),
            max_seqlen_k=max(ctx, default=0),
            start_pos=t(starts, torch.long), context_lens=t(ctx, torch.int32),
            slot_mapping=t(v["slot_mapping"], torch.long),
            block_tables=torch.tensor([list(r) for r in v["block_tables"]],
                                      dtype=torch.int32, device=device),
            block_size=plan.block_size, q_lens=tuple(q_lens),
            start_positions=tuple(starts), num_padding_rows=len(plan.padding))
        return RaggedBatch(t(v["input_ids"], torch.long),
                           t(v["positions"], torch.long), meta,
                           t(v["logits_indices"], torch.long),
                           tuple(v["sample_request_ids"]))
    return to_batch


def test_a_tiny_model_runs_on_your_lists(solution, monkeypatch):
    import torch

    import minicb.runtime.runner as runner
    from minicb.core.config import ModelConfig, SchedulerConfig
    from minicb.core.sampling_params import SamplingParams
    from minicb.model.llama import LlamaForCausalLM
    from minicb.runtime.baseline import generate_padded

    packer = pick(solution, "pack", _reference.pack)
    made, calls = batches(packer), []

    def counted(plan, *args):
        calls.append(plan)
        return made(plan, *args)
    monkeypatch.setattr(runner, "pack", counted)
    cfg = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, eos_token_id=3)
    model = LlamaForCausalLM.random(cfg, seed=0, dtype=torch.float64, std=0.3)
    rng = random.Random(1)
    prompts = [[rng.randrange(4, 61) for _ in range(rng.randint(2, 14))]
               for _ in range(6)]
    params = SamplingParams(max_tokens=6)
    want = generate_padded(model, prompts, params, eos_token_id=3).token_ids
    for policy in ("continuous", "static"):
        sched = SchedulerConfig(max_num_seqs=4, num_blocks=16, block_size=4,
                                max_num_batched_tokens=10, policy=policy)
        eng = runner.engine_for(model, sched, attn_backend="reference")
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
        eng.close_arrivals()
        done = {}
        for _ in range(300):
            if not eng.has_unfinished_requests():
                break
            for out in eng.step():
                if out.error:
                    pytest.fail(f"the engine failed a step on your packed "
                                f"lists: {out.error}")
                if out.finished:
                    done[out.request_id] = out.token_ids
        got = [done.get(f"r{i}") for i in range(len(prompts))]
        for i in range(len(prompts)):
            assert got[i] == want[i], (
                f"{policy} batching: a tiny model run on your packed lists "
                f"generated {got[i]} for prompt {i}, a padded batch "
                f"{want[i]}: a field the model reads is wrong")
    assert any(p.padding for p in calls) and any(
        s.start_pos for p in calls for s in p.seqs), \
        "the runs must pack padding rows and cached rows (the checker is wrong)"
