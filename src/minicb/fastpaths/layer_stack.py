"""Every decoder layer of a CPU step in one C call: the layers' own kernels, without Python between them.

On the CPU fast paths (``fast_paths.cpu_fast_paths``) a SmolLM2 decoder layer is a dozen calls from
Python into C: two fused norms, the rotary embedding, four skinny products, the cache write, the
decode kernel, the SiLU. Each call checks its arguments, converts them through ``ctypes`` and makes a
torch tensor for its result; thirty layers a step, that is milliseconds whatever the step's size (a
quarter of a one-sequence decode step: ``bench/decode_floor.py``'s "fwd oth"). vLLM's CPU build
compiles its model's graph to lose the same cost. The graph of a LLaMA layer is short enough to
write down, so ``layer_stack.c`` does: it calls the same C functions, in the same order, on the same
buffers, and so computes what the layers compute, bit for bit (``tests/model/test_layer_stack.py``
compares every step's output with the layers' own).

Threads: the C loop is one OpenMP parallel region a step, of ``torch.get_num_threads()`` threads,
which take the step's work as numbered items (shares of a product's panels, runs of the other parts'
rows) from one queue, each part's items once the part before is done (``layer_stack.c`` draws it,
``team_queue.h`` is the queue); every thread count gives the same bits (``bench/decode_floor.py
--thread-scaling`` times 1 against 2 threads).

A step qualifies when all of its attention is the C kernels' (``cpu_paged``'s ``_DecodeRows``, a
decode step, or ``_PromptTiles``, where prompt chunks go to the prompt kernel: on the AVX-512 row),
it has at most as many rows as the skinny kernel takes, and the model is fused and packed
throughout; any other step runs the layers as before. ``MINICB_LAYER_STACK=0`` turns it off.

A bfloat16 model loaded from a GGUF gets a second table beside the first: the same layers with the
products' panels made from the file's Q4_1 or Q8_0 blocks (``skinny_gemm.pack_blocks``, checked to
stand for exactly the bfloat16 weights), which steps of up to ``block_rows`` rows (one, by default)
read with the blocks' kernel, the same bits from 3/8 (Q4_1) or 9/16 (Q8_0) of the bytes. A weight
replaced after that (its panels' storage changed) turns the blocks off: they would be the old one's.
With ``MINICB_INT8_PRODUCTS=1`` (Q4_1 blocks) a third table multiplies int8-rounded activations by
the blocks in every step it takes (``int8_gemm``), and the layers' packed products do the same in the
steps it does not (``cpu_linear.Int8Products``): one arithmetic for every step of a sequence.

``install(model)`` switches a model's class to ``StackedLlama``, whose ``hidden`` (the part of
``LlamaForCausalLM.forward`` between the embedding and the LM head) tries the stack first and hands
any other step to the layers; ``LLM`` does it on the CPU fast paths.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import torch

from minicb.fastpaths import ckernels, cpu_fused, cpu_linear, int8_gemm, skinny_gemm
from minicb.fastpaths.settings import Settings
from minicb.model.llama import LlamaForCausalLM

SOURCE = Path(__file__).parent / "csrc" / "layer_stack.c"
_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Kernels(ctypes.Structure):
    _fields_ = [(n, _ptr) for n in ("skinny", "norm", "add_norm", "rope", "silu", "decode", "prompt",
                                    "quantize")]


class _Layer(ctypes.Structure):
    _fields_ = [(n, _ptr) for n in ("input_norm", "qkv", "o", "post_norm", "gate_up", "down", "k_cache",
                                    "v_cache")]


class _Dims(ctypes.Structure):
    _fields_ = [(n, _i64) for n in ("rows", "hidden", "q_heads", "kv_heads", "head_dim", "inter", "elem",
                                    "max_blocks", "block_size", "max_context", "qstride")] + [
        ("eps", ctypes.c_double), ("scale", ctypes.c_double), ("nthreads", ctypes.c_int)]


class _Prompts(ctypes.Structure):
    _fields_ = [("tiles", _ptr), ("seq_tables", _ptr), ("n_tiles", _i64), ("seq_max_blocks", _i64),
                ("decode_rows", _ptr), ("n_decodes", _i64)]


class _Buffers(ctypes.Structure):
    _fields_ = [(n, _ptr) for n in ("x", "h", "qkv", "q", "attn", "a", "gu", "act", "xq")]


@functools.cache
def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The compiled ``layer_stack.c`` (built on the first call); ``KernelUnavailable`` if it cannot be.
    ``extra_flags`` builds a variant (``bench/decode_floor.py --stack-builds`` times two side by side)."""
    lib = ckernels.open_library(ckernels.build(SOURCE, extra_flags=extra_flags), "the compiled layer stack")
    lib.minicb_layer_stack.argtypes = [_ptr] * 2 + [_i64] + [_ptr] * 9
    lib.minicb_layer_stack.restype = ctypes.c_int
    return lib


def unavailable_reason() -> str | None:
    """None when ``layer_stack.c`` builds and loads here, else why not."""
    return ckernels.why_not(load)


def enabled(settings: Settings | None = None) -> bool:
    """False when ``MINICB_LAYER_STACK=0`` keeps the layers' own calls."""
    return (settings or Settings.from_env()).layer_stack


def _address(fn) -> int:
    return ctypes.cast(fn, _ptr).value


class LayerStack:
    """What ``layer_stack.c`` needs of one model: its kernels, and its weights, checked once here so
    that the C loop can trust them. It holds the weight tensors it was installed with (a module given
    a new tensor later needs ``install`` again); their addresses are read every step, so a tensor
    whose storage was replaced (``.data = ...``) is followed."""

    def __init__(self, model: LlamaForCausalLM, gguf_blocks: dict | None = None,
                 settings: Settings | None = None) -> None:
        from minicb.fastpaths import cpu_paged

        cfg, dtype = model.config, model.dtype
        self.why_not = _unstackable(model)
        if self.why_not:
            return
        self.lib = load()
        self.kernels = _Kernels(_address(skinny_gemm._c_function(dtype, part=True)),
                                *(_address(cpu_fused._c_function(n, dtype))
                                  for n in ("rmsnorm", "add_rmsnorm", "rope", "silu_mul")),
                                _address(getattr(cpu_paged.load(), cpu_paged.kernel_name(dtype))),
                                _address(getattr(cpu_paged.load_prompt(),
                                                 cpu_paged.kernel_name(dtype, prompt=True))))
        layers = self.model_layers = model.model.layers
        self.skinny_rows = min(m.skinny_rows for layer in layers for m in _products(layer))
        # the tensors, not their addresses: a model moved or reloaded in place gets new ones, which
        # every step reads again (a few microseconds) before it trusts its table
        self.tensors = [(layer.input_layernorm.weight, layer.self_attn.qkv_packed.weight_panels,
                         layer.self_attn.o_proj.weight_panels, layer.post_attention_layernorm.weight,
                         layer.mlp.gate_up_packed.weight_panels, layer.mlp.down_proj.weight_panels)
                        for layer in layers]
        self.final = model.model.norm.weight
        self.cfg, self.dtype = cfg, dtype
        # which products a step can run: the bfloat16 panels; _add_blocks adds "blocks" and "int8"
        self.products: dict[str, tuple[list, _Kernels]] = {"bf16": (self.tensors, self.kernels)}
        self._tables: dict[str, tuple] = {}      # by products: (the addresses it was made from, the table)
        self.block_rows, self.block_why = self._add_blocks(model, gguf_blocks or {}, settings)

    def _checked_blocks(self, blocks: dict) -> list[list[np.ndarray]] | str:
        """Per layer, the GGUF blocks of its four products (q, k, v and gate, up stacked as the packed
        weights are), each checked to stand for exactly the bfloat16 weight its panels hold
        (``skinny_gemm.panels_of_blocks``); else why not."""
        cfg = self.cfg
        qdim, kvdim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        shapes = ((qdim + 2 * kvdim, cfg.hidden_size), (cfg.hidden_size, qdim),
                  (2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size))
        layers = []
        for i, ts in enumerate(self.tensors):
            pre = f"model.layers.{i}."
            names = ([f"{pre}self_attn.{n}_proj.weight" for n in "qkv"], [f"{pre}self_attn.o_proj.weight"],
                     [f"{pre}mlp.{n}_proj.weight" for n in ("gate", "up")], [f"{pre}mlp.down_proj.weight"])
            layer = []
            for group, panels, (out_f, in_f) in zip(names, ts[1:3] + ts[4:], shapes):
                if not all(n in blocks for n in group) or len({blocks[n].shape[1:] for n in group}) != 1:
                    return f"{group[0]} has no blocks of one kind"
                stacked = np.concatenate([blocks[n] for n in group])
                if skinny_gemm.panels_of_blocks(stacked, panels, out_f, in_f) is None:
                    return f"{group[0]}'s blocks are not its bfloat16 weights"
                layer.append(stacked)
            layers.append(layer)
        if len({b.shape[2] for layer in layers for b in layer}) != 1:
            return "the layers' blocks are of more than one kind"
        return layers

    def _with_products(self, packed: list[list[torch.Tensor]], skinny_part, quantize=None
                       ) -> tuple[list, _Kernels]:
        """The layers' tensors with ``packed`` products in place of the bfloat16 panels, and the
        kernels with ``skinny_part`` (a ``_part`` entry of the same signature) as the product;
        ``quantize``: what rounds its input rows first (``int8_gemm.c``)."""
        tensors = [(ts[0], p[0], p[1], ts[3], p[2], p[3]) for ts, p in zip(self.tensors, packed)]
        others = (getattr(self.kernels, n) for n, _ in _Kernels._fields_[1:-1])
        return tensors, _Kernels(_address(skinny_part), *others, quantize and _address(quantize))

    def _add_blocks(self, model: LlamaForCausalLM, blocks: dict, settings: Settings | None
                    ) -> tuple[int, str]:
        """Panels of the GGUF's blocks (``skinny_gemm.pack_blocks``) for every layer's products and the
        LM head, for steps of up to ``block_rows`` rows; ``(0, why not)`` unless every product has
        blocks that stand for exactly the bfloat16 weights its panels hold (``_checked_blocks``). With
        ``MINICB_INT8_PRODUCTS=1`` and Q4_1 blocks, every step's products on int8 activations instead
        (``int8_gemm``; ``self.int8``)."""
        self.int8, self.int8_why = False, "no GGUF blocks"
        if self.dtype != torch.bfloat16:
            self.int8_why = f"a {str(self.dtype).removeprefix('torch.')} model (they are for bfloat16)"
        if self.dtype != torch.bfloat16 or not blocks:
            return 0, "no GGUF blocks"
        rows, why = skinny_gemm.choose_block_rows(settings)
        int8, self.int8_why = int8_gemm.choose(settings)
        if not rows and not int8:
            return 0, why
        checked = self._checked_blocks(blocks)
        if isinstance(checked, str):
            self.int8_why = checked
            return 0, checked
        if int8 and checked[0][0].shape[2] != int8_gemm.Q4_1_BYTES:
            self.int8_why = "the layers' blocks are not Q4_1"
        elif int8:
            self.int8 = True
            packed = [[int8_gemm.pack(b) for b in layer] for layer in checked]
            lib = int8_gemm.load()
            self.products["int8"] = self._with_products(packed, lib.minicb_int8_q4_part,
                                                        lib.minicb_int8_quantize)
            for layer, panels in zip(model.model.layers, packed):    # the steps the stack does not take
                for module, p in zip(_products(layer), panels):
                    module.read_int8(p)
        lm = self.lm_head = model.lm_head
        self._blocks_of = self._panels()
        if not rows:
            return 0, why
        if not self.int8:                         # (int8 products take every step the stack runs)
            kernel = skinny_gemm.BLOCK_KINDS[checked[0][0].shape[2]][1]
            self.products["blocks"] = self._with_products(
                [[skinny_gemm.pack_blocks(b) for b in layer] for layer in checked],
                getattr(skinny_gemm.load(), kernel + "_part"))
        head = "lm_head.weight" if "lm_head.weight" in blocks else "model.embed_tokens.weight"
        if isinstance(lm, cpu_linear.PackedLinear) and lm.skinny_rows and head in blocks:
            panels = skinny_gemm.panels_of_blocks(blocks[head], lm.weight_panels, lm.out_features,
                                                  lm.in_features)
            if panels is not None:                # no more rows than its own skinny panels take
                lm.read_blocks(panels, min(rows, lm.skinny_rows))
        return rows, why

    def _panels(self) -> tuple[int, ...]:
        """Where the bfloat16 panels the blocks were checked against are (the LM head's too)."""
        head = getattr(self.lm_head, "weight_panels", None)
        return (*(t.data_ptr() for ts in self.tensors for t in ts), 0 if head is None else head.data_ptr())

    def takes(self, x: torch.Tensor, backend, state) -> bool:
        """Whether this step is all the kernels' (a single ``_DecodeRows`` or ``_PromptTiles`` that is
        the whole step), of a paged cache, with few enough rows for the skinny kernel."""
        from minicb.fastpaths.cpu_paged import CpuPagedAttention, _DecodeRows, _PromptTiles

        groups = getattr(state, "groups", None) or ()
        return (not self.why_not and isinstance(backend, CpuPagedAttention) and backend.kv_cache is not None
                and x.dtype == self.dtype and 0 < x.shape[0] <= self.skinny_rows and len(groups) == 1
                and (isinstance(groups[0], _DecodeRows) and groups[0].tokens is None
                     or isinstance(groups[0], _PromptTiles) and groups[0].whole))

    def _layer_table(self, kv_cache, products: str = "bf16") -> ctypes.Array:
        """The layers' addresses for ``layer_stack.c`` (made again when a weight or the cache moved);
        ``products``: ``bf16`` (the bfloat16 panels), ``blocks`` (the GGUF's blocks) or ``int8``."""
        tensors = self.products[products][0]
        key = (kv_cache.data.data_ptr(), *(t.data_ptr() for ts in tensors for t in ts))
        if products not in self._tables or self._tables[products][0] != key:
            table = (_Layer * len(tensors))()
            for i, ts in enumerate(tensors):
                kc, vc = kv_cache.layer(i)
                table[i] = _Layer(*(t.data_ptr() for t in ts), kc.data_ptr(), vc.data_ptr())
            self._tables[products] = (key, table)
        return self._tables[products][1]

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend, state) -> torch.Tensor:
        """Every layer on ``x [rows, hidden]`` (updated in place), then the final norm: what the layers
        and ``model.norm`` return, for a step ``takes`` accepted."""
        from minicb.fastpaths.cpu_paged import _PromptTiles, check_decode_args

        cfg, g = self.cfg, state.groups[0]
        rows, hidden, d = x.shape[0], cfg.hidden_size, cfg.head_dim
        qdim, kvdim, inter = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
        kc, vc = backend.kv_cache.layer(0)
        bs = backend.kv_cache.block_size
        empty = functools.partial(torch.empty, dtype=x.dtype)
        h, q, attn, a = empty(rows, hidden), empty(rows, qdim), empty(rows, qdim), empty(rows, hidden)
        qkv, gu, act = empty(rows, qdim + 2 * kvdim), empty(rows, 2 * inter), empty(rows, inter)
        prompts, dec = None, g
        if isinstance(g, _PromptTiles):      # prompt tiles, and the step's decode rows one by one
            dec = g.decodes
            g.check(q.view(rows, -1, d), kc, vc, bs)       # what the layers' first call would check
            rows_of = None if dec is None else dec.tokens      # int64: the decode rows' rows of q
            prompts = _Prompts(g.tiles.data_ptr(), g.block_tables.data_ptr(), g.tiles.shape[0],
                               g.block_tables.shape[1], None if dec is None else rows_of.data_ptr(),
                               0 if dec is None else rows_of.numel())
        if dec is not None and not dec.checked:
            check_decode_args(q.view(rows, -1, d)[:dec.context_lens.numel()], kc, vc, dec.block_tables,
                              dec.context_lens, bs, dec.max_context)
            dec.checked = True
        for t in (x, cos, sin):
            cpu_fused._check("layer_stack", t)
        slots = state.slot_mapping.contiguous()
        if slots.dtype != torch.int64 or slots.shape != (rows,) or cos.shape != (rows, d):
            raise ValueError(f"layer_stack: slot_mapping {slots.dtype} {tuple(slots.shape)} or cos "
                             f"{tuple(cos.shape)} does not match {rows} rows")
        tables = (g if dec is None else dec).block_tables
        gguf = rows <= self.block_rows        # few rows: the products read the GGUF's blocks (same bits)
        if (gguf or self.int8) and self._panels() != self._blocks_of:   # a weight replaced: stale blocks
            if self.int8:
                for layer in self.model_layers:
                    for module in _products(layer):
                        module.read_int8(None)
            self.block_rows, gguf, self.int8 = 0, False, False
            self.block_why = self.int8_why = "a weight was replaced after the blocks were packed"
            if isinstance(self.lm_head, cpu_linear.PackedLinear):
                self.lm_head.read_blocks(None, 0)
        products = "int8" if self.int8 else "blocks" if gguf else "bf16"
        # int8: a product's input rows rounded once, in rows of qstride 2-byte units (int8_gemm.c)
        qstride = int8_gemm.row_bytes(max(hidden, qdim, inter)) // 2 if products == "int8" else 0
        xq = torch.empty(rows * qstride * 2, dtype=torch.uint8) if qstride else None
        dims = _Dims(rows, hidden, cfg.num_attention_heads, cfg.num_key_value_heads, d, inter,
                     x.element_size(), tables.shape[1], bs, 0 if dec is None else dec.max_context, qstride,
                     cfg.rms_norm_eps, d ** -0.5, torch.get_num_threads())
        bufs = _Buffers(*(t.data_ptr() for t in (x, h, qkv, q, attn, a, gu, act)),
                        None if xq is None else xq.data_ptr())
        failed = self.lib.minicb_layer_stack(
            ctypes.byref(self.products[products][1]),
            self._layer_table(backend.kv_cache, products),
            len(self.tensors),
            self.final.data_ptr(),
            ctypes.byref(dims), ctypes.byref(bufs), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
            tables.data_ptr(), None if dec is None else dec.context_lens.data_ptr(),
            None if prompts is None else ctypes.byref(prompts))
        if failed:
            raise MemoryError("paged_decode or paged_prompt could not allocate its scratch")
        return h


def _products(layer) -> tuple:
    """A decoder layer's four packed products, in the stack's order: q/k/v, o, gate/up, down."""
    return layer.self_attn.qkv_packed, layer.self_attn.o_proj, layer.mlp.gate_up_packed, layer.mlp.down_proj


def _unstackable(model: LlamaForCausalLM) -> str | None:
    """None when every layer is fused and packed with skinny panels (what ``layer_stack.c`` calls),
    else what is missing."""
    if model.dtype not in cpu_fused.DTYPES or model.device.type != "cpu":
        return f"a {model.dtype} model on {model.device}"
    if not isinstance(model.model.norm, cpu_fused.FusedRMSNorm):
        return "the final norm is not fused"
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        parts = (isinstance(layer, cpu_fused.FusedDecoderLayer),
                 isinstance(layer.input_layernorm, cpu_fused.FusedRMSNorm),
                 isinstance(layer.post_attention_layernorm, cpu_fused.FusedRMSNorm),
                 isinstance(attn, cpu_linear.PackedQKV) and isinstance(attn, cpu_fused.FusedAttention),
                 isinstance(mlp, cpu_linear.PackedGateUp) and isinstance(mlp, cpu_fused.FusedMLP))
        if not all(parts):
            return f"layer {i} is not fused and packed throughout"
        if not all(getattr(p, "skinny_rows", 0) > 0 for p in _products(layer)):
            return f"layer {i} has no skinny panels"
        if {layer.input_layernorm.eps, layer.post_attention_layernorm.eps} != {model.model.norm.eps}:
            return f"layer {i}'s norms have another eps"
    return None


class StackedLlama(LlamaForCausalLM):
    """``LlamaForCausalLM`` whose steps run ``LayerStack`` where it takes them, the layers elsewhere."""

    def hidden(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend, state,
               logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        if not self.layer_stack.takes(x, backend, state):
            return super().hidden(x, cos, sin, backend, state, logits_indices)
        h = self.layer_stack.run(x, cos, sin, backend, state)       # the final norm included
        return h if logits_indices is None else h[logits_indices]


def install(model: LlamaForCausalLM, gguf_blocks: dict | None = None, settings: Settings | None = None
            ) -> str | None:
    """Give ``model`` the stack (its class becomes ``StackedLlama``); None when done, else why not (the
    model is left as it is). Builds the C loop first: a missing compiler raises ``KernelUnavailable``.
    ``gguf_blocks``: the GGUF's quantized weights (``LoadedModel.gguf_blocks``), for steps of one row."""
    stack = LayerStack(model, gguf_blocks, settings)
    if stack.why_not:
        return stack.why_not
    model.layer_stack = stack
    model.__class__ = StackedLlama
    return None
