"""What prompt logprobs cost: time and resident memory of ``prompt_logprobs: 20`` on long prompts,
each computed beside a running decode, and whether the memory comes back when they end.

    python bench/logprob_memory.py                          # 20 requests of 8,000 prompt tokens
    python bench/logprob_memory.py --requests 5 --prompt-tokens 2000 --top 5
    python bench/logprob_memory.py --model default          # SmolLM2 itself (its prefill dominates)
    python bench/logprob_memory.py --keep-heap              # without handing the C heap's free pages back

The default model is a random LLaMA of 2 small layers with SmolLM2's vocabulary (49,152 tokens) and
tokenizer: the prefill costs little, so what is measured is the logprob work (the LM head over every
prompt row, the logprobs, the per-token entries of the output), which is the part that scales with
the vocabulary. The engine is ``LLM``'s (2,048-token steps). For each request: the wall time and the
steps it took, then the process's resident memory (``/proc/self/statm``) after the request has ended
and ``gc.collect()`` ran, against the resident memory before the first (after one warm-up request),
and the peak. Issue 46 saw 475 MB kept for good by a server after such requests. ``--keep-heap`` skips
``runtime.logprobs.release_heap`` (glibc's ``malloc_trim`` after a step that scored prompt rows), to
show what the C heap keeps without it.

A run on 2 shared cores (torch 2.13, the default random model): 20 requests of 8,000 tokens, resident
memory +4 MB after all 20 against before them (peak 881 MB while one is scored); without
``release_heap`` (``--keep-heap``) it wandered between -35 and +87 MB and ended +66 MB. Against the
code before issue 46 (``git archive b51ac8a src``, the same script with ``PYTHONPATH`` on it), 4,000-token
requests took 15-17 s there and 8-11 s here, its resident memory ending between -126 and +137 MB of
where it began, here +1 MB. (Wall times on a shared machine vary by 2x from run to run; compare
runs made back to back.)
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import time

import torch

from minicb.core.config import ModelConfig, SchedulerConfig
from minicb.core.sampling_params import SamplingParams
from minicb.model.llama import LlamaForCausalLM
from minicb.runtime.runner import engine_for


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def model_and_tokenizer(which: str, max_len: int):
    from minicb.model.text.tokenizer import Tokenizer
    from minicb.model.weights.gguf_loader import read_gguf
    from minicb.model.weights.loader import default_model_path, load_model

    if which == "default":
        m = load_model()
        return LlamaForCausalLM.from_state_dict(m.config, m.state_dict), m.tokenizer
    with read_gguf(default_model_path()) as g:
        tokenizer = Tokenizer.from_gguf_metadata(g.metadata)
    cfg = ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=max_len, eos_token_id=2)
    return LlamaForCausalLM.random(cfg, seed=0, dtype=torch.float32, std=0.3), tokenizer


def one(engine, rid: str, prompt: list[int], top: int) -> tuple[float, int, int]:
    """A prompt-logprobs request beside a running decode: (seconds, steps, prompt rows returned)."""
    engine.add_request(f"decode-{rid}", prompt[:16], SamplingParams(max_tokens=4000, ignore_eos=True))
    engine.step()                                     # the decode is running before the long prompt comes
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, prompt_logprobs=top))
    start, steps, rows = time.perf_counter(), 0, 0
    while True:
        steps += 1
        outs = [o for o in engine.step() if o.request_id == rid and o.finished]
        if outs:
            rows = len(outs[0].prompt_logprobs) - 1
            break
    seconds = time.perf_counter() - start
    engine.abort_request(f"decode-{rid}")
    while engine.has_unfinished_requests():
        engine.step()
    return seconds, steps, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--top", type=int, default=20, help="prompt_logprobs (top-k per prompt token)")
    ap.add_argument("--model", default="random", choices=["random", "default"])
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--keep-heap", action="store_true", help="do not hand the C heap's free pages back")
    args = ap.parse_args()
    if args.keep_heap:
        import minicb.runtime.runner as runner

        runner.release_heap = lambda: None
    torch.manual_seed(0)
    max_len = args.prompt_tokens + 64
    model, tokenizer = model_and_tokenizer(args.model, max_len)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=args.max_num_batched_tokens,
                             block_size=16, num_blocks=2 * max_len // 16 + 64, max_model_len=max_len)
    engine = engine_for(model, config, tokenizer)
    vocab = model.config.vocab_size
    prompts = [torch.randint(4, vocab, (args.prompt_tokens,)).tolist() for _ in range(args.requests + 1)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; model {args.model}, vocabulary "
          f"{vocab}; {args.requests} requests of {args.prompt_tokens} prompt tokens, prompt_logprobs "
          f"{args.top}, {args.max_num_batched_tokens}-token steps, each beside a running decode"
          f"{'; the C heap kept (--keep-heap)' if args.keep_heap else ''}")
    one(engine, "warm-up", prompts[-1], args.top)
    gc.collect()
    before = resident_mb()
    print(f"resident before: {before:.0f} MB (after one warm-up request)")
    for i in range(args.requests):
        seconds, steps, rows = one(engine, f"r{i}", prompts[i], args.top)
        gc.collect()
        print(f"request {i + 1:2}: {seconds:6.2f} s, {steps} steps, {rows} prompt rows; resident "
              f"{resident_mb():.0f} MB ({resident_mb() - before:+.0f} MB)")
    gc.collect()
    after = resident_mb()
    print(f"resident after {args.requests} requests: {after:.0f} MB ({after - before:+.0f} MB against "
          f"before); peak {peak_mb():.0f} MB")


if __name__ == "__main__":
    main()
