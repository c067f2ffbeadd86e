"""A row's kind (``core.plan.row_kind``) at its boundaries, and the scheduler's prefix-cache reset.

The rule is "a row that starts inside its prompt is a prefill, whatever its length"; the edges are
where a start position equals the prompt's length (the first decode) and one before it (the last
prompt token, computed alone).
"""

from __future__ import annotations

from minicb.core.config import SchedulerConfig
from minicb.core.plan import DECODE, PREFILL, row_kind
from minicb.core.sampling_params import SamplingParams
from minicb.core.scheduler import Scheduler
from minicb.core.sequence import Sequence


def test_a_row_starting_at_the_prompts_end_is_the_first_decode():
    assert row_kind(start_pos=9, num_tokens=1, num_prompt_tokens=9) == DECODE
    assert row_kind(start_pos=12, num_tokens=1, num_prompt_tokens=9) == DECODE


def test_a_one_token_row_inside_the_prompt_is_a_prefill():
    assert row_kind(start_pos=8, num_tokens=1, num_prompt_tokens=9) == PREFILL    # the last chunk
    assert row_kind(start_pos=0, num_tokens=1, num_prompt_tokens=1) == PREFILL    # a 1-token prompt


def test_a_recompute_refeed_past_the_prompt_is_a_prefill():
    assert row_kind(start_pos=9, num_tokens=3, num_prompt_tokens=9) == PREFILL


def test_the_scheduler_resets_its_prefix_cache_only_when_idle():
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, block_size=4, num_blocks=8,
                          max_model_len=32)
    sched = Scheduler(cfg)
    assert sched.reset_prefix_cache() is True               # nothing held: done
    sched.add(Sequence("a", list(range(4, 13)), SamplingParams(max_tokens=2, ignore_eos=True)))
    plan = sched.schedule(0.0)
    sched.update(plan, {s.request_id: 5 for s in plan.seqs if s.sample}, 1.0)
    assert sched.reset_prefix_cache() is False              # "a" holds (cached) blocks
    while sched.has_unfinished():
        plan = sched.schedule(0.0)
        sched.update(plan, {s.request_id: 5 for s in plan.seqs if s.sample}, 1.0)
    assert sched.reset_prefix_cache() is True
