"""The sampling knobs through the engine (tiny random model, float64, the tiny BPE tokenizer).

Every request's tokens are the same

* alone, in a roomy engine;
* in a mixed batch of requests with other knobs, on a KV pool small enough to preempt (swap and
  recompute): the processors' state (generated-token counts, histograms) must be right after a
  recompute, which re-prefills prompt and output and samples once at its end;
* as the padded static batch gives them;
* and, for greedy requests, as a plain loop gives them that recomputes the whole sequence from
  scratch every step (no KV cache) and applies ``knob_reference``'s rules to the last row.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drain import drain, finals
from helpers import assert_drained, tiny_model
from knob_reference import ref_scores
from minicb.core.config import ModelConfig, SchedulerConfig
from minicb.core.errors import InvalidArgument
from minicb.core.sampling_params import SamplingParams
from minicb.model.attention import ReferenceAttention
from minicb.runtime.baseline import generate_padded
from minicb.runtime.logits_processors import bad_words_token_ids
from minicb.runtime.packer import pack_prompts
from minicb.runtime.runner import engine_for
from tokenizer_fixtures import tiny_tokenizer

TOK = tiny_tokenizer()
EOS = TOK.eos_token_id
CFG = ModelConfig(vocab_size=266, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                  max_position_embeddings=4096, eos_token_id=EOS)
MAX = 14

PLAIN = SamplingParams(max_tokens=MAX)
SAMPLED = {i: SamplingParams(max_tokens=MAX, temperature=t, seed=s, top_k=k, top_p=p)     # requests 7-9
           for i, t, s, k, p in [(7, 0.9, 7, 0, 1.0), (8, 1.2, 8, 20, 1.0), (9, 0.7, 9, 0, 0.9)]}


def words(tokens: list[int], n: int) -> tuple[str, ...]:
    """The text of the first ``n`` generated tokens that are a word of their own (their text encodes
    back to them alone)."""
    texts = [TOK.decode([t]) for t in tokens]
    return tuple(w for t, w in zip(tokens, texts) if TOK.encode(w.lstrip()) == [t])[:n]


def knobs(plain: list[list[int]]) -> list[SamplingParams]:
    """One knob (or a few) per request, chosen to bite on that request's prompt: stop ids and bad words
    are tokens its plain run generates (``test_every_knob_changes_its_request`` checks)."""
    sp = SamplingParams
    return [
        PLAIN,
        sp(max_tokens=MAX, frequency_penalty=1.5, presence_penalty=0.7),
        sp(max_tokens=MAX, presence_penalty=-2.0),
        sp(max_tokens=MAX, logit_bias={EOS: 30.0, 100: 5.0}, min_tokens=9),
        sp(max_tokens=MAX, min_tokens=MAX, stop_token_ids=(plain[4][1], plain[4][3])),
        sp(max_tokens=MAX, bad_words=words(plain[5], 2)),
        sp(max_tokens=MAX, repetition_penalty=2.5),
        sp(max_tokens=MAX, temperature=0.9, seed=7, repetition_penalty=1.3, min_p=0.05),
        sp(max_tokens=MAX, temperature=1.2, seed=8, frequency_penalty=2.0, top_k=20,
           logit_bias={EOS: -100.0, plain[8][2]: -100.0}),
        sp(max_tokens=MAX, temperature=0.7, seed=9, bad_words=words(plain[9], 1), min_tokens=4,
           top_p=0.9),
    ]


def model():
    return tiny_model(CFG)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, CFG.vocab_size, (int(torch.randint(3, 30, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def run(config: SchedulerConfig, plist, params) -> tuple[list, object]:
    eng = engine_for(model(), config, TOK)
    for i, (p, sp) in enumerate(zip(plist, params)):
        eng.add_request(f"r{i}", p, sp)
    outs = finals(drain(eng, max_steps=10_000))
    assert_drained(eng)
    return [outs[f"r{i}"] for i in range(len(plist))], eng


def roomy() -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, block_size=4, num_blocks=256,
                           max_model_len=512)


def tight(mode: str) -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=40, long_prefill_chunk=8, block_size=4,
                           num_blocks=14, num_host_blocks=40 if mode == "swap" else 0, max_model_len=512,
                           preemption_mode=mode)


def from_scratch(prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy, the simplest way: the whole sequence through the model every step, the reference's rules
    on its last row, stop on EOS / a stop id once more than min_tokens tokens came, or at max_tokens."""
    bad = bad_words_token_ids(p.bad_words, TOK)
    out: list[int] = []
    while len(out) < p.max_tokens:
        b = pack_prompts([prompt + out])
        logits = model()(b.input_ids, b.positions, ReferenceAttention(None), b.attn, b.logits_indices)
        tok = int(np.argmax(ref_scores(logits[-1].numpy(), p, prompt, out, EOS, bad)))
        out.append(tok)
        if (tok == EOS or tok in p.stop_token_ids) and len(out) > p.min_tokens:
            break
    return out


N = 10


@pytest.fixture(scope="module")
def alone():
    """The prompts, each request's knobs, and its tokens alone."""
    plist = prompts(N)
    plain = [run(roomy(), [p], [SAMPLED.get(i, PLAIN)])[0][0].token_ids for i, p in enumerate(plist)]
    ks = knobs(plain)
    return plist, ks, [run(roomy(), [p], [sp])[0][0].token_ids for p, sp in zip(plist, ks)]


def test_every_knob_changes_its_request(alone):
    """Else the tests below could not tell a knob that works from one that is ignored."""
    plist, ks, tokens = alone
    for p, sp, got in zip(plist, ks, tokens):
        if sp != PLAIN:
            unset = SamplingParams(max_tokens=MAX, temperature=sp.temperature, seed=sp.seed, top_k=sp.top_k,
                                   top_p=sp.top_p)
            assert got != run(roomy(), [p], [unset])[0][0].token_ids, sp


def test_greedy_knobs_match_a_from_scratch_loop(alone):
    plist, ks, tokens = alone
    for p, sp, got in zip(plist, ks, tokens):
        if sp.greedy:
            assert got == from_scratch(p, sp), sp


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_knobs_are_batch_independent_and_survive_preemption(alone, mode):
    plist, ks, want = alone
    order = [3, 6, 7, 5, 9, 1, 4, 8, 2, 0]              # a different batch order than alone
    outs, eng = run(tight(mode), [plist[i] for i in order], [ks[i] for i in order])
    assert sum(o.num_preemptions for o in outs) > 0, "the pool is meant to force preemption"
    for o, i in zip(outs, order):
        assert o.token_ids == want[i], ks[i]
    base = generate_padded(model(), plist, ks, eos_token_id=EOS, tokenizer=TOK).token_ids
    assert base == want


def test_min_tokens_holds_off_a_strongly_favoured_eos_then_lets_it_end(alone):
    _, ks, tokens = alone
    got = tokens[3]                            # logit_bias EOS +30, min_tokens 9
    assert EOS not in got[:9] and got[9] == EOS and len(got) == 10
    assert not set(tokens[4]) & {*ks[4].stop_token_ids, EOS} and len(tokens[4]) == MAX   # to the very end


def test_bad_words_never_appear_and_the_text_skips_special_tokens_unless_asked(alone):
    _, ks, tokens = alone
    for i in (5, 9):
        for w in bad_words_token_ids(ks[i].bad_words, TOK):
            assert not any(tokens[i][j:j + len(w)] == w for j in range(len(tokens[i])))
    plist = prompts(1, seed=3)
    special = SamplingParams(max_tokens=6, logit_bias={1: 100.0}, ignore_eos=True)   # <|im_start|>
    shown = SamplingParams(max_tokens=6, logit_bias={1: 100.0}, ignore_eos=True, skip_special_tokens=False)
    (a, b), _ = run(roomy(), plist * 2, [special, shown])
    assert a.token_ids == b.token_ids == [1] * 6
    assert a.text == "" and b.text == "<|im_start|>" * 6


def test_a_logit_bias_outside_the_vocabulary_or_bad_words_without_a_tokenizer_are_refused():
    eng = engine_for(model(), roomy(), TOK)
    with pytest.raises(InvalidArgument, match="logit_bias"):
        eng.add_request("r", [5, 6], SamplingParams(logit_bias={CFG.vocab_size: 1.0}))
    bare = engine_for(model(), roomy())
    with pytest.raises(InvalidArgument, match="bad_words"):
        bare.add_request("r", [5, 6], SamplingParams(bad_words=("a",)))
    assert not eng.has_unfinished_requests() and not bare.has_unfinished_requests()
    assert not eng.runner.sampler._processors and not bare.runner.sampler._processors
