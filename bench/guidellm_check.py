"""guidellm against ``minicb serve``: its streaming benchmark on both endpoints, 0 errors.

    python -m venv /tmp/guidellm-venv && /tmp/guidellm-venv/bin/pip install guidellm   # never the main env
    python bench/guidellm_check.py --guidellm /tmp/guidellm-venv/bin/guidellm          # a few minutes
    python bench/guidellm_check.py --guidellm ... --url http://127.0.0.1:8000          # a server already up

guidellm sends every streaming request with ``stream_options: {include_usage: true,
continuous_usage_stats: true}``, ``ignore_eos: true`` and ``stop: null`` (its request handlers); it
counts a request as errored when the server refuses any of it. This starts ``minicb serve``
(SmolLM2-135M-Instruct, float32) on a free port unless ``--url`` names one, writes the model's
tokenizer where guidellm's ``AutoTokenizer`` can load it (guidellm makes its synthetic prompts to a
token count with it), and runs two benchmarks of ``--requests`` requests each, 64 prompt tokens and 16
output tokens: synchronous on ``/v1/completions`` and ``--streams`` concurrent streams on
``/v1/chat/completions``. Prints each benchmark's successful / errored / incomplete counts from
guidellm's JSON report and exits non-zero unless every request succeeded.

``tests/serve/test_serve_vllm_fields.py`` sends guidellm's exact request shapes to the tiny model in CI
(guidellm itself is no test dependency).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def start_server() -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "minicb", "serve", "--port", "0", "--served-model-name", "smollm2",
           "--max-num-seqs", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if " on http" not in line:
        raise SystemExit(f"minicb serve did not start: {line!r}")
    return proc, line.split(" on ", 1)[1].split()[0]


def write_tokenizer(where: pathlib.Path) -> pathlib.Path:
    """SmolLM2's tokenizer from its GGUF as a directory ``transformers.AutoTokenizer`` loads."""
    sys.path.insert(0, str(ROOT / "src"))
    from minicb.model.text.tokenizer import Tokenizer
    from minicb.model.weights.loader import default_model_path

    tok = Tokenizer.from_gguf(default_model_path())
    tok._tk.save(str(where / "tokenizer.json"))
    (where / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "bos_token": "<|im_start|>"}))
    return where


def run(guidellm: str, url: str, tokenizer: pathlib.Path, out: pathlib.Path, route: str, profile: str,
        requests: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [guidellm, "run", "--backend", f"kind=openai_http,target={url},request_format={route}",
           "--profile", profile, "--constraint", f"kind=max_requests,count={requests}",
           "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}", "--disable-progress"]
    subprocess.run(cmd, cwd=out, check=True, stdout=subprocess.DEVNULL)
    report = json.loads((out / "benchmarks.json").read_text())
    counts = report["benchmarks"][0]["requests"]
    return {k: len(v) if isinstance(v, list) else v for k, v in counts.items() if k != "total"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--guidellm", default="guidellm", help="the guidellm command (its own venv)")
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--streams", type=int, default=4)
    args = ap.parse_args(argv)
    proc, url = (None, args.url) if args.url else start_server()
    failed = False
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = pathlib.Path(tmp)
            tokenizer = write_tokenizer(tmp)
            for route, profile in (("/v1/completions", "kind=synchronous"),
                                   ("/v1/chat/completions", f"kind=concurrent,streams={args.streams}")):
                got = run(args.guidellm, url, tokenizer, tmp / route.strip("/").replace("/", "_"), route,
                          profile, args.requests)
                ok = got.get("successful") == args.requests and not got.get("errored") \
                    and not got.get("incomplete")
                failed |= not ok
                print(f"{route:22} {profile:28} {got}  {'ok' if ok else 'FAILED'}")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
