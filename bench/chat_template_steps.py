"""How many template steps (lines of the template's own code) a chat template runs per message.

    python bench/chat_template_steps.py                 # SmolLM2's template and the tests' ChatML
    python bench/chat_template_steps.py --messages 1024

``minicb.model.text.chat_template`` bounds a render by counts, not by the clock: ``MAX_RENDER_STEPS``
template lines and ``MAX_RENDER_WORK`` characters built. This prints, for the most messages a server
accepts (``--max-messages``), the steps and the work a real template needs, and how many times that
the limits leave, so the limit's headroom is a printed figure rather than a guess. Counts are the same
on any machine, busy or quiet.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from minicb.entrypoints.serve.limits import ServeLimits
from minicb.model.text import chat_template as ct


def count(source: str, messages: list[dict]) -> tuple[int, int]:
    """(steps, characters built) of one render of ``source`` over ``messages``."""
    guards = []
    real = ct._Guard

    class Counting(real):
        def __init__(self):
            super().__init__()
            guards.append(self)

    ct._Guard = Counting
    try:
        ct.render(source, messages=messages, add_generation_prompt=True, bos_token="<s>", eos_token="</s>",
                  pad_token=None)
    finally:
        ct._Guard = real
    return guards[0].lines, guards[0].work


def templates() -> dict[str, str]:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    from tokenizer_fixtures import CHATML

    out = {"ChatML (tests)": CHATML}
    try:
        from minicb.model.weights.gguf_loader import read_gguf
        from minicb.model.weights.loader import default_model_path

        with read_gguf(default_model_path()) as g:
            out["SmolLM2-135M-Instruct"] = g.metadata["tokenizer.chat_template"]
    except Exception as e:  # noqa: BLE001 - the default model is optional here
        print(f"(SmolLM2's template skipped: {e})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=ServeLimits().max_messages)
    args = ap.parse_args()
    messages = [{"role": ("user", "assistant")[i % 2], "content": "hello there " * 20}
                for i in range(args.messages)]
    print(f"{args.messages} messages; limits: {ct.MAX_RENDER_STEPS:,} steps, "
          f"{ct.MAX_RENDER_WORK:,} characters")
    for name, source in templates().items():
        steps, work = count(source, messages)
        print(f"{name:24} {steps:>9,} steps ({steps / args.messages:.1f} per message, limit x"
              f"{ct.MAX_RENDER_STEPS / steps:.0f})  {work:>11,} characters built (limit x"
              f"{ct.MAX_RENDER_WORK / max(work, 1):.0f})")


if __name__ == "__main__":
    main()
