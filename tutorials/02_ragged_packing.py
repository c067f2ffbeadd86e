"""Chapter 02: ragged packing and cu_seqlens.

Run: python tutorials/02_ragged_packing.py

Continuous batching mixes, in one forward step, a decode token of one request, a whole prompt of
another and a prompt chunk of a third. Instead of a padded [batch, max_len] tensor, minicb (like vLLM
and SGLang) lays every scheduled token end to end in one flat tensor and records where each request's
tokens start: ``cu_seqlens``. ``minicb.packer.pack`` turns a ``StepPlan`` into these tensors.
"""

from __future__ import annotations

import torch
from _common import chapter, explain, prompt_ids, section, tiny_model

from minicb.config import SchedulerConfig
from minicb.engine import LLMEngine
from minicb.model.attention import ReferenceAttention
from minicb.packer import pack, pack_prompts
from minicb.sampling_params import SamplingParams


def show_flat(plan, batch) -> None:
    """The flat token tensor with one label per token, then the offsets under it."""
    labels = []
    for s in plan.seqs:
        labels += [f"{s.request_id}_{s.start_pos + j}" for j in range(s.num_tokens)]
    print("flat tokens   : [ " + ", ".join(f"{lab:>4}" for lab in labels) + " ]")
    print("input_ids     : [ " + ", ".join(f"{t:>4}" for t in batch.input_ids.tolist()) + " ]")
    print("positions     : [ " + ", ".join(f"{t:>4}" for t in batch.positions.tolist()) + " ]")
    cu = batch.attn.cu_seqlens_q.tolist()
    marks = [" "] * (len(labels) * 6 + 1)
    for c in cu:
        marks[c * 6] = "^"
    print("boundaries    :  " + "".join(marks))
    print(f"cu_seqlens_q = {cu}")
    print(f"cu_seqlens_k = {batch.attn.cu_seqlens_k.tolist()}   (keys: cached tokens + new ones)")
    print(f"context_lens = {batch.attn.context_lens.tolist()}")
    print(f"slot_mapping = {batch.attn.slot_mapping.tolist()}   (block_table[pos // 4] * 4 + pos % 4)")
    print(f"block_tables = {batch.attn.block_tables.tolist()}   (one row per sequence, 0-padded)")


def main() -> None:
    chapter(2, "ragged packing and cu_seqlens")
    explain("""
        The seed's example: the flat sequence [TokenA_0, TokenB_37, TokenC_0, TokenC_1, TokenC_2] with
        cu_seqlens [0, 1, 2, 5]. We make it happen with the real engine: request B has a 37-token prompt
        and is decoding position 37; A (a 1-token prompt) and C (a 3-token prompt) arrive. minicb's
        planner puts decodes first, so B's token leads, but the offsets are the seed's.
    """)
    model = tiny_model()
    # prefix caching (sharing the blocks of common prompt prefixes) is off: plain, private block tables
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=32,
                          enable_prefix_caching=False)
    eng = LLMEngine(model, cfg)
    plans = []
    eng.listen(on_plan=lambda event: plans.append(event.plan))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    eng.add_request("B", prompt_ids(37, 1), params)
    eng.step()                                   # B's 37-token prefill; samples the token at position 37
    eng.add_request("A", prompt_ids(1, 0), params)
    eng.add_request("C", prompt_ids(3, 2), params)
    eng.step()                                   # B decodes position 37; A and C prefill
    plan = plans[-1]

    section("1. the StepPlan the scheduler made (plain Python, no tensors)")
    for s in plan.seqs:
        kind = "decode" if s.num_tokens == 1 and s.start_pos > 0 else "prompt"
        print(f"  {s.request_id}: slot {s.slot_id}, {kind}, tokens at positions "
              f"{s.start_pos}..{s.start_pos + s.num_tokens - 1}, block_table {list(s.block_table)}, "
              f"sample={s.sample}")

    section("2. pack(plan): one flat tensor, no padding")
    batch = pack(plan)
    show_flat(plan, batch)
    n_seqs = len(plan.seqs)
    longest = max(s.num_tokens for s in plan.seqs)
    print(f"\nflat tokens computed: {batch.num_tokens}")
    print(f"a padded [batch={n_seqs}, max_len={longest}] tensor would compute {n_seqs * longest} "
          f"token rows, {n_seqs * longest - batch.num_tokens} of them padding")
    explain("""
        Every layer except attention works token by token, so it does not care which request a row
        belongs to. Attention uses cu_seqlens to keep requests apart: the query rows
        cu_seqlens_q[i]:cu_seqlens_q[i+1] attend only to request i's own keys (its cached blocks, found
        through its block table, plus its new tokens). FlashAttention's varlen kernel takes exactly
        these arrays; minicb's reference backend does the same in plain PyTorch.
    """)

    section("3. proof that packing keeps requests apart")
    prompts = [prompt_ids(1, 0), prompt_ids(37, 1), prompt_ids(3, 2)]
    packed = pack_prompts(prompts)
    backend = ReferenceAttention(None)
    together = model(packed.input_ids, packed.positions, backend, packed.attn, packed.logits_indices)
    diffs = []
    for i, p in enumerate(prompts):
        alone = pack_prompts([p])
        logits = model(alone.input_ids, alone.positions, backend, alone.attn, alone.logits_indices)
        lo, hi = packed.attn.cu_seqlens_q[i].item(), packed.attn.cu_seqlens_q[i + 1].item()
        diffs.append((together[lo:hi] - logits).abs().max().item())
    print(f"three whole prompts packed: cu_seqlens_q = {packed.attn.cu_seqlens_q.tolist()}")
    print(f"max |logits packed - logits alone| per request: {diffs}")
    print(f"largest difference: {max(diffs):.3e} (float64)")
    print(f"same logits as running each request alone (up to float64 rounding): {max(diffs) < 1e-12}")
    assert torch.isfinite(together).all()


if __name__ == "__main__":
    main()
