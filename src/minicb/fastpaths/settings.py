"""Every switch of the CPU fast paths, read from the environment in one place.

The fast paths choose themselves at load (which GEMM, how many rows on the skinny kernel, prompts on
the decode kernel or on SDPA, ...); each choice can be pinned by an environment variable, for a
benchmark or for a CPU the automatic choice gets wrong. This module is the only one in minicb that
reads them: ``Settings.from_env()`` reads all of them at once, and the fast paths are handed the
result (``install`` reads it once per model load; a backend keeps the one it was built with), so a
step never looks at the environment. ``SWITCHES`` is the table in ``docs/fast_paths_switches.md``
(a test checks the two agree)::

    MINICB_LINEAR=mkl minicb generate "Hi"      # pin the GEMM path for this run
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# (environment variable, field, default, what it does)
SWITCHES: tuple[tuple[str, str, str, str], ...] = (
    ("MINICB_LINEAR", "linear", "auto",
     "the GEMM of linear layers: auto, torch, mkl, onednn-f32, onednn-bf16"),
    ("MINICB_SKINNY_ROWS", "skinny_rows", "",
     "steps of up to N rows go to the skinny kernel (0: off; unset: chosen for the CPU)"),
    ("MINICB_BLOCK_ROWS", "block_rows", "",
     "steps of up to N rows read a bfloat16 model's GGUF blocks as stored (0: off; unset: by CPU)"),
    ("MINICB_INT8_PRODUCTS", "int8_products", "",
     "1: a Q4_1 GGUF's layers multiply int8-rounded activations (other numbers; needs AVX-512 VNNI)"),
    ("MINICB_FUSED_OPS", "fused_ops", "1", "0: the reference RMSNorm, rotary embedding and SiLU"),
    ("MINICB_LAYER_STACK", "layer_stack", "1", "0: decoder layers called one by one, never in one C call"),
    ("MINICB_HUGE_PAGES", "huge_pages", "1", "0: the skinny kernel's weight copies on plain pages"),
    ("MINICB_PACKED_LM_HEAD", "packed_lm_head", "1", "0: no oneDNN packing at all (MKL's F.linear)"),
    ("MINICB_GREEDY_HEAD", "greedy_head", "1",
     "0: all-greedy steps compute every logit (not only the panels that can hold the argmax)"),
    ("MINICB_BF16_DECODE", "bf16_decode", "native",
     "widen: the bfloat16 decode kernel widens to float32 instead of native dot products"),
    ("MINICB_PROMPT_ATTENTION", "prompt_attention", "",
     "kernel or sdpa: where prompt chunks are attended (unset: chosen for the CPU)"),
    ("MINICB_CACHE_DIR", "cache_dir", "", "where compiled C kernels are kept (default ~/.cache/minicb)"),
    ("CC", "cc", "", "the C compiler the kernels are built with (default: Python's, else cc)"),
)


@dataclass(frozen=True)
class Settings:
    """One reading of every switch (``SWITCHES``); the defaults are the automatic choices."""

    linear: str = "auto"
    skinny_rows: str = ""
    block_rows: str = ""
    int8_products: str = ""
    fused_ops: bool = True
    layer_stack: bool = True
    huge_pages: bool = True
    packed_lm_head: bool = True
    greedy_head: bool = True
    bf16_decode: str = "native"
    prompt_attention: str = ""
    cache_dir: str = ""
    cc: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read every switch from ``env`` (default ``os.environ``); an unset one keeps its default.
        On/off switches are on unless set to ``0``. Values are checked where they are used, with a
        message naming the variable."""
        env = os.environ if env is None else env
        values = {}
        for var, name, default, _ in SWITCHES:
            raw = env.get(var, default)
            values[name] = raw != "0" if default == "1" else raw
        if not values["cache_dir"]:            # the XDG convention, then the home folder
            values["cache_dir"] = os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                               "minicb")
        return cls(**values)


def markdown_table() -> str:
    """``SWITCHES`` as the Markdown table of the docs page (the test compares the page with it)."""
    rows = ["| variable | default | what it does |", "| --- | --- | --- |"]
    rows += [f"| `{var}` | {f'`{d}`' if d else 'unset'} | {what} |" for var, _, d, what in SWITCHES]
    return "\n".join(rows) + "\n"
