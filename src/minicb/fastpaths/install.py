"""Installing the fast paths: what a model loaded for serving gets on the CPU, and what its runner is handed.

``cpu_fast_paths(model, device)`` is what ``LLM`` (and so ``minicb generate`` and ``minicb serve``) and
``minicb bench`` do to a model they load themselves; benchmarks that build their model by hand call
it to run the same thing. A model built by hand and given to ``LLM`` is left as it is.

1. the norms and rotary embedding in float32 and bfloat16 as small C loops (``cpu_fused``; one
   warning line when they cannot be built, and the reference ops stay);
2. every linear layer on the GEMM ``cpu_linear.choose_path`` picks for this CPU (``MINICB_LINEAR``
   pins it): packed once for oneDNN in float32 or bfloat16, or MKL's float32 ``F.linear`` with the
   LM head alone packed;
3. on the oneDNN paths, the products of steps of up to so many rows (decode steps, and on most
   CPUs prompt chunks too) on the skinny kernel, where ``skinny_gemm.choose_rows`` says the CPU runs it well
   (``MINICB_SKINNY_ROWS`` pins it), its weights on 2 MiB pages where the OS allows them
   (``host_memory``; ``MINICB_HUGE_PAGES=0`` keeps plain ones);
4. with all of those, the decoder layers of a step whose rows are all decode-kernel rows in one C
   call (``layer_stack``; ``MINICB_LAYER_STACK=0`` keeps the layers' own calls);
5. for a bfloat16 model read from a GGUF's Q4_1 / Q8_0 weights (``LoadedModel.gguf_blocks``), steps
   of one row multiply from those blocks as stored, 3/8 (Q4_1) or 9/16 (Q8_0) of the bfloat16 bytes,
   with the same bits (``skinny_gemm.pack_blocks``; ``MINICB_BLOCK_ROWS`` pins how many rows, 0: never).
   With ``MINICB_INT8_PRODUCTS=1`` (Q4_1 only; AVX-512 VNNI or AVX2), every decoder-layer product, in
   the layer stack and out of it, multiplies int8-rounded activations by those blocks instead: other
   numbers, faster (``int8_gemm``).

Which GEMM, and why, is one INFO line on the ``minicb.load`` logger, once per load (``minicb:
float32 linear layers on onednn-f32: packed oneDNN 2.09x MKL on a 16x576x960 float32 product
(flags: ...); steps of up to 4096 rows on the skinny kernel (its AVX-512 path)``). A library user sees
it with ``logging``'s usual switches; the command line
shows it on stderr (``show_load_lines``), because a speed figure means little without it.
"""

from __future__ import annotations

import functools
import logging
import sys

import torch

from minicb.fastpaths import backends, cpu_fused, cpu_linear, greedy_head, layer_stack, skinny_gemm
from minicb.fastpaths.ckernels import KernelUnavailable
from minicb.fastpaths.settings import Settings

LOAD_LOGGER = "minicb.load"
_log = logging.getLogger("minicb")
_load_log = logging.getLogger(LOAD_LOGGER)
_FUSED_FALLBACK_LOGGED: set[str] = set()


def cpu_fast_paths(model, device, settings: Settings | None = None,
                   gguf_blocks: dict | None = None) -> list[str]:
    """Put ``model`` on the CPU's fast paths, in place (module docstring); the names of what was
    applied (``["packed-linears-f32", "fused-ops"]``, ...). Nothing on another device. ``settings``:
    the switches (default: read from the environment now, once). ``gguf_blocks``: the GGUF's quantized
    weights the model was loaded from (``LoadedModel.gguf_blocks``), which a bfloat16 model reads in
    steps of one row (``layer_stack``, the LM head)."""
    applied = []
    if torch.device(device).type != "cpu":
        return applied
    settings = settings or Settings.from_env()
    qkv = model.config.hidden_size, (model.config.num_attention_heads
                                     + 2 * model.config.num_key_value_heads) * model.config.head_dim
    # first: a refused pin leaves the model as is
    path, why = cpu_linear.choose_path(model.dtype, *qkv, settings=settings)
    if model.dtype in cpu_fused.DTYPES and settings.fused_ops:
        reason = cpu_fused.unavailable_reason()
        if reason is None:
            cpu_fused.fuse_elementwise(model)          # before packing: it knows the modules by class
            applied.append("fused-ops")
        elif reason not in _FUSED_FALLBACK_LOGGED:
            _FUSED_FALLBACK_LOGGED.add(reason)
            _log.warning("minicb: fused CPU ops unavailable, using the reference ops: %s", reason)
    rows, rows_why = skinny_gemm.choose_rows(model.dtype, settings) if path.startswith("onednn") else (0, "")
    linears = cpu_linear.apply_path(model, path, skinny_rows=rows)
    if "fused-ops" in applied and rows and settings.layer_stack:
        try:
            why_not = layer_stack.install(model, gguf_blocks, settings)
        except KernelUnavailable as e:
            why_not = str(e)
        if why_not is None:
            applied.append("layer-stack")
            if model.layer_stack.block_rows:
                applied.append(f"gguf-blocks-{model.layer_stack.block_rows}-rows")
            if model.layer_stack.int8:
                applied.append("int8-products")
        else:
            _log.info("minicb: decoder layers called one by one: %s", why_not)
    if model.dtype in cpu_fused.DTYPES:               # float64 has one GEMM: nothing was chosen
        rows = cpu_linear.skinny_rows_of(model)
        skinny = (f"; steps of up to {rows} rows on the skinny kernel ({rows_why})" if rows else
                  f"; no skinny kernel ({rows_why})" if rows_why else "")
        stack = getattr(model, "layer_stack", None)
        blocks = getattr(stack, "block_rows", 0)
        skinny += f", up to {blocks} from the GGUF's blocks as stored" if blocks else ""
        if settings.int8_products == "1":        # asked for: say whether it is used, and why not
            skinny += ("; the layers' products on int8 activations (MINICB_INT8_PRODUCTS=1)"
                       if stack and stack.int8 else
                       f"; no int8 products: {getattr(stack, 'int8_why', 'no layer stack')}")
        _load_log.info("minicb: %s linear layers on %s: %s%s", str(model.dtype).removeprefix("torch."),
                       path, why, skinny)
    return linears + applied


def runner_kwargs(settings: Settings | None = None) -> dict:
    """What a runner is handed to run on the fast paths (``runtime.runner.engine_for(...,
    **runner_kwargs())``): the attention backends with the C decode kernel, and the C greedy argmax
    (unless ``MINICB_FUSED_OPS=0``)."""
    settings = settings or Settings.from_env()
    return {"make_backend": functools.partial(backends.make_backend, settings=settings),
            "argmax": cpu_fused.greedy_argmax if settings.fused_ops else None,
            "greedy_head": functools.partial(greedy_head.for_model, settings=settings)}


class _StderrHandler(logging.Handler):
    """Writes each record's message to whatever ``sys.stderr`` is when it is emitted (a test's
    captured stream, a closed one: then nothing)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if sys.stderr is not None:
                sys.stderr.write(record.getMessage() + "\n")
                sys.stderr.flush()
        except (OSError, ValueError):
            pass


def show_load_lines() -> None:
    """Show the ``minicb.load`` lines (which GEMM path, and why) on stderr: the commands call this
    before they load a model. Idempotent."""
    if not any(isinstance(h, _StderrHandler) for h in _load_log.handlers):
        _load_log.addHandler(_StderrHandler())
    _load_log.setLevel(logging.INFO)
