"""The reference mode: ``LLM(fast_paths=False)`` / ``minicb generate --reference`` runs the model as
``minicb/model`` reads, and gives the fast paths' greedy tokens exactly in float64.

The prompts are the 16 SmolLM2 check prompts (code, French, a haiku, chat-templated questions, a
repeated sentence, a 60-token passage), generated with a small step budget so that prompts are
chunked and decodes share steps with prefills. float32 and bfloat16 are not compared here: their
agreement with float64 is a measured figure (``python bench/agreement.py``), never asserted.
"""

from __future__ import annotations

import pytest
import torch

from minicb.core.sampling_params import SamplingParams
from minicb.entrypoints.llm import LLM
from minicb.fastpaths.install import cpu_fast_paths
from minicb.measure.workloads import smollm2_prompt_ids
from minicb.model.attention import ReferenceAttention
from minicb.model.llama import LlamaDecoderLayer, LlamaForCausalLM, RMSNorm

pytestmark = [pytest.mark.model, pytest.mark.slow]
SMALL = dict(max_num_seqs=8, max_num_batched_tokens=48, block_size=16, num_blocks=256)


def _model(loaded) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_state_dict(loaded.config, loaded.state_dict, torch.float64)


def test_greedy_float64_tokens_are_the_same_with_and_without_the_fast_paths(smollm2):
    prompts = smollm2_prompt_ids(smollm2.tokenizer)
    params = SamplingParams(max_tokens=24)
    ref = LLM(_model(smollm2), tokenizer=smollm2.tokenizer, fast_paths=False, **SMALL)
    fast_model = _model(smollm2)
    cpu_fast_paths(fast_model, "cpu")                 # what LLM() does to a model it loads itself
    fast = LLM(fast_model, tokenizer=smollm2.tokenizer, **SMALL)
    # the two really run different code: the reference's own modules and attention, torch's argmax
    assert type(ref.engine.runner.backend) is ReferenceAttention and ref.engine.runner.sampler.argmax is None
    assert all(type(m) in (LlamaDecoderLayer, RMSNorm) for m in ref.engine.runner.model.modules()
               if isinstance(m, (LlamaDecoderLayer, RMSNorm)))
    assert fast.engine.runner.backend.name == "cpu-paged"
    got_ref = [o.token_ids for o in ref.generate(prompts, params)]
    got_fast = [o.token_ids for o in fast.generate(prompts, params)]
    assert got_ref == got_fast
    assert sum(map(len, got_ref)) > 16 * 8            # real continuations, not empty answers


def test_the_reference_layers_are_what_runs(smollm2, monkeypatch):
    """In the reference mode every decoder layer's own ``forward`` runs once per layer and step."""
    calls = []
    real = LlamaDecoderLayer.forward
    monkeypatch.setattr(LlamaDecoderLayer, "forward", lambda self, *a: calls.append(1) or real(self, *a))
    llm = LLM(_model(smollm2), tokenizer=smollm2.tokenizer, fast_paths=False, **SMALL)
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3
    steps = llm.engine.stats.num_steps
    assert len(calls) == steps * smollm2.config.num_hidden_layers


def test_the_reference_mode_refuses_a_fast_path_backend_by_name(smollm2):
    with pytest.raises(Exception, match="cpu-paged is a CPU fast path"):
        LLM(_model(smollm2), tokenizer=smollm2.tokenizer, fast_paths=False, attn_backend="cpu-paged", **SMALL)


def test_minicb_generate_reference_prints_the_fast_paths_text(smollm2_path, capsys):
    from minicb.entrypoints.cli import main

    args = ["generate", "Water is made of hydrogen and", "--model", str(smollm2_path), "--dtype", "float64",
            "--max-tokens", "6"]
    assert main(args + ["--reference"]) == 0
    reference = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == reference and reference.strip()
