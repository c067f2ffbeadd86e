"""Read a LLaMA-architecture GGUF file into a Hugging Face-style state dict.

GGUF is llama.cpp's single-file model format. Laid end to end, a file is::

    "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x (key: string, value_type: u32, value)            <- metadata: shape, tokenizer, chat template
    n_tensors x (name: string, n_dims: u32, dims: u64[n_dims], ggml_type: u32, offset: u64)
    padding up to `general.alignment` (default 32)
    tensor data (each tensor at data_start + offset)

(strings are ``u64 length + UTF-8 bytes``; arrays are ``element_type u32 + count u64 + elements``;
everything little-endian). We parse this header ourselves, in a few dozen lines, instead of with
``gguf.GGUFReader``: the reader builds a numpy view for every one of the ~100,000 vocabulary strings
and merges, which costs seconds on a small CI machine; ``struct.unpack_from`` over an ``mmap`` costs
a tenth of a second. The ``gguf`` package still provides the names of the types and block sizes, and
the tests check our parse and our dequantization against it.

Three translations turn the file into what ``LlamaForCausalLM`` expects:

1. **Names.** ``blk.{i}.attn_q.weight`` -> ``model.layers.{i}.self_attn.q_proj.weight`` and so on
   (``_NAME_MAP`` below).
2. **Shapes.** GGUF lists dimensions fastest-first (``ne[0]`` is the length of a row), so a linear
   weight stored as ``[in, out]`` is a row-major ``[out, in]`` array: exactly ``nn.Linear.weight``.
   Reversing the dimension list is the whole transformation; nothing is transposed.
3. **The Q/K row permutation.** Hugging Face's LLaMA applies RoPE to *halves* of each head
   (``rotate_half``: dimension ``j`` pairs with ``j + d/2``); llama.cpp rotates *adjacent pairs*
   (``2j`` with ``2j + 1``). So llama.cpp's converter reorders the output rows of ``q_proj`` and
   ``k_proj`` inside each head, ``w.reshape(n_head, 2, d/2, in).swapaxes(1, 2)``, which interleaves
   the two halves. We apply the inverse, ``w.reshape(n_head, d/2, 2, in).swapaxes(1, 2)``, to get the
   Hugging Face rows back (``unpermute_qk``). For ``k_proj`` ``n_head`` is the number of KV heads.

Quantized tensors are stored in blocks of 32 values that share a scale; ``dequantize`` expands them
to float32 with whole-array numpy operations (no Python loop over blocks). Supported types:
``SUPPORTED_TYPES``. Any other type raises ``ModelLoadError`` naming the tensor, before any work.

A damaged file is an error, never a crash, a hang or a huge allocation: every count and length the
header declares (strings, arrays, numbers of keys and tensors, dimensions, tensor extents) is checked
against the bytes the file actually has *before* it is used, metadata values must have the types the
format gives them, and anything that still goes wrong while parsing becomes ``ModelLoadError``.

Nor does a file that parses get to produce garbage: what the header claims is checked against the
data. Tensors must lie end to end with only alignment padding between them (``_check_layout``), so
aliased or overlapping offsets and a quantisation type that does not match the bytes are refused;
metadata numbers must be finite (and ``ModelConfig`` bounds them); and every weight must be finite
(checked for both formats by ``loader.check_finite``).
"""

from __future__ import annotations

import math
import mmap
import os
import pathlib
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from minicb.core.config import ModelConfig
from minicb.core.errors import InvalidArgument, ModelLoadError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4              # GGML_MAX_DIMS
MAX_NESTING = 8           # arrays of arrays: real files use one level
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

# struct format and size of each scalar metadata type.
_SCALARS: dict[int, tuple[str, int]] = {
    GGUFValueType.UINT8: ("<B", 1), GGUFValueType.INT8: ("<b", 1),
    GGUFValueType.UINT16: ("<H", 2), GGUFValueType.INT16: ("<h", 2),
    GGUFValueType.UINT32: ("<I", 4), GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4), GGUFValueType.BOOL: ("<?", 1),
    GGUFValueType.UINT64: ("<Q", 8), GGUFValueType.INT64: ("<q", 8),
    GGUFValueType.FLOAT64: ("<d", 8),
}
# numpy dtype of each scalar type, for reading a whole numeric array in one call.
_NUMPY: dict[int, str] = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}

# GGUF tensor name (after "blk.{i}.") -> Hugging Face name (after "model.layers.{i}.").
_LAYER_NAME_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAME_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(slots=True, frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file. ``shape`` is numpy (row-major) order, slowest dim first."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int          # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"unknown type {self.ggml_type}"


@dataclass(slots=True)
class GGUFFile:
    """A parsed GGUF header plus the memory-mapped file its tensor data lives in."""

    path: pathlib.Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    _mm: mmap.mmap

    def raw(self, name: str) -> np.ndarray:
        """The bytes of tensor ``name`` as a uint8 view into the file (no copy)."""
        info = self.tensors[name]
        return np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:  # a view returned by raw() is still alive; the GC closes the map later
            pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------
# Parsing the header
# --------------------------------------------------------------------------------------------------

class _Cursor:
    """Reads little-endian values from a buffer, advancing an offset.

    Every declared length or count is checked against the bytes left before it is used, so a corrupt
    header fails at once instead of looping over (or allocating for) billions of phantom elements.
    """

    __slots__ = ("buf", "pos")

    def __init__(self, buf, pos: int = 0) -> None:
        self.buf, self.pos = buf, pos

    def left(self) -> int:
        return len(self.buf) - self.pos

    def need(self, count: int, item_size: int, what: str) -> None:
        """Raise if ``count`` items of at least ``item_size`` bytes cannot fit in what is left."""
        if count * item_size > self.left():
            raise ModelLoadError(f"the header declares {count} {what} at byte {self.pos}, but only "
                                 f"{self.left()} bytes are left (corrupt or truncated)")

    def scalar(self, vtype: int):
        fmt, size = _SCALARS[vtype]
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self) -> int:
        return self.scalar(GGUFValueType.UINT32)

    def u64(self) -> int:
        return self.scalar(GGUFValueType.UINT64)

    def string(self) -> str:
        n = self.u64()
        self.need(n, 1, "string bytes")
        start = self.pos
        self.pos += n
        return self.buf[start:self.pos].decode("utf-8", errors="replace")

    def value(self, vtype: int, depth: int = 0):
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            if depth >= MAX_NESTING:
                raise ModelLoadError(f"metadata arrays nested more than {MAX_NESTING} deep (corrupt header)")
            etype, count = self.u32(), self.u64()
            if etype in _NUMPY:     # numeric array: one numpy read, then plain Python values
                self.need(count, _SCALARS[etype][1], "array elements")
                arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            if etype not in (GGUFValueType.STRING, GGUFValueType.ARRAY):
                raise ModelLoadError(f"unknown metadata array element type {etype} (corrupt header)")
            self.need(count, 8, "array elements")       # a string or an array is at least 8 bytes
            return [self.value(etype, depth + 1) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ModelLoadError(f"unknown metadata value type {vtype} (corrupt header)")
        return self.scalar(vtype)


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse the header of the GGUF file at ``path`` and memory-map it. Raises ``ModelLoadError``."""
    path = pathlib.Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            if head != GGUF_MAGIC:
                raise ModelLoadError(
                    f"{path} is not a GGUF file: it starts with {head!r}, not {GGUF_MAGIC!r}")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    try:
        return _parse(path, mm)
    except ModelLoadError:
        mm.close()
        raise
    except (struct.error, ValueError, IndexError, OverflowError, RecursionError, MemoryError) as e:
        mm.close()
        raise ModelLoadError(f"{path} is not a valid GGUF file (corrupt or truncated header: "
                             f"{type(e).__name__}: {e})") from e


def _parse(path: pathlib.Path, mm: mmap.mmap) -> GGUFFile:
    try:
        return _parse_header(path, mm)
    except ModelLoadError as e:
        msg = str(e)
        raise ModelLoadError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from e


def _parse_header(path: pathlib.Path, mm: mmap.mmap) -> GGUFFile:
    cur = _Cursor(mm, 4)
    version = cur.u32()
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version > 0xFFFF else ""
        raise ModelLoadError(f"{path}: GGUF version {version}{hint} is not supported; versions 2 and 3 are")
    n_tensors, n_kv = cur.u64(), cur.u64()
    cur.need(n_kv, 8 + 4 + 1, "metadata keys")         # key length, value type, a 1-byte value at least
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.u32())
    cur.need(n_tensors, 8 + 4 + 4 + 8, "tensors")      # name length, n_dims, type, offset at least
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.u32()
        if n_dims > MAX_DIMS:
            raise ModelLoadError(f"tensor {_short(name)} declares {n_dims} dimensions; GGUF allows at most "
                                 f"{MAX_DIMS} (corrupt header)")
        dims = [cur.u64() for _ in range(n_dims)]
        ggml_type, offset = cur.u32(), cur.u64()
        infos.append((name, dims, ggml_type, offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not _is_int(alignment) or not 1 <= alignment <= len(mm):
        raise ModelLoadError(f"general.alignment must be a positive integer, got {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, dims, ggml_type, offset in infos:
        if name in tensors:
            raise ModelLoadError(f"tensor {_short(name)} is declared twice (corrupt header)")
        tensors[name] = _tensor_info(path, name, dims, ggml_type, data_start + offset, len(mm))
        if offset % alignment:
            raise ModelLoadError(f"tensor {_short(name)} starts at data offset {offset}, not a multiple "
                                 f"of the alignment {alignment} (corrupt header)")
    _check_layout(tensors, alignment, len(mm))
    return GGUFFile(path, version, metadata, tensors, mm)


def _check_layout(tensors: dict[str, GGUFTensorInfo], alignment: int, file_size: int) -> None:
    """The data section is the tensors end to end, in the order of their offsets, with only alignment
    padding between them (how every GGUF writer lays them out). The header alone cannot be trusted to
    say that: two tensors given one offset (aliased) or overlapping offsets would read each other's
    bytes, and a type swapped in the header (Q4_0 for a tensor written as Q8_0) makes its declared size
    disagree with the bytes that are there. Both produce garbage weights without any other error."""
    laid = sorted(tensors.values(), key=lambda t: t.offset)
    for a, b in zip(laid, laid[1:]):
        gap = b.offset - (a.offset + a.nbytes)
        if gap < 0:
            raise ModelLoadError(f"tensors {_short(a.name)} and {_short(b.name)} overlap: {a.nbytes} bytes "
                                 f"at {a.offset} reach past {b.offset} (aliased offsets or a wrong type)")
        if gap >= alignment:
            raise ModelLoadError(f"tensor {_short(a.name)} is {a.type_name} of shape {list(a.shape)}, "
                                 f"{a.nbytes} bytes, but the data holds {b.offset - a.offset} bytes before "
                                 "the next tensor (a wrong type or shape in the header)")
    if laid and file_size - (laid[-1].offset + laid[-1].nbytes) >= alignment:
        last = laid[-1]
        raise ModelLoadError(f"tensor {_short(last.name)} is {last.type_name} of shape {list(last.shape)}, "
                             f"{last.nbytes} bytes, but {file_size - last.offset} bytes follow it to the end "
                             "of the file (a wrong type or shape in the header)")


def _tensor_info(path, name: str, dims: list[int], ggml_type: int, offset: int, file_size: int):
    """Check one tensor's declared extent against the file (exact integers: no overflow) and type."""
    n = math.prod(dims)
    block, type_size = GGML_QUANT_SIZES.get(ggml_type, (1, 0))  # unknown types: rejected at load
    if dims and dims[0] % block:
        raise ModelLoadError(f"{path}: tensor {_short(name)} has rows of {dims[0]} values, not a multiple of "
                             f"the {block}-value blocks of its type (corrupt header)")
    nbytes = n // block * type_size
    if offset + nbytes > file_size:
        raise ModelLoadError(f"{path}: tensor {_short(name)} declares {nbytes} bytes at offset {offset}, "
                             f"past the end of the {file_size}-byte file (truncated or corrupt)")
    return GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, offset, nbytes)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# --------------------------------------------------------------------------------------------------
# Dequantization
# --------------------------------------------------------------------------------------------------

def _scale(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at bytes ``start:start+2`` of each block, as a float32 column ``[n_blocks, 1]``."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[n_blocks, 16]`` bytes -> ``[n_blocks, 32]`` float32 4-bit values 0..15.

    The low nibbles are elements 0-15 of the block and the high nibbles elements 16-31. Writing
    straight into the float32 output (``out=``, ``casting="unsafe"``) avoids a uint8 temporary and a
    concatenate: this function is most of the load time of a 4-bit model.
    """
    out = np.empty((qs.shape[0], 32), np.float32)
    np.bitwise_and(qs, 0x0F, out=out[:, :16], casting="unsafe")
    np.right_shift(qs, 4, out=out[:, 16:], casting="unsafe")
    return out


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Expand the raw bytes of one tensor to a new float32 array of ``shape``.

    The block formats (32 weights per block, stored along a row; ``d`` and ``m`` are float16)::

        Q8_0: d, 32 x int8            w = d * q
        Q4_0: d, 16 bytes of nibbles  w = d * (q - 8)
        Q4_1: d, m, 16 bytes          w = d * q + m

    The arithmetic is float32 in the same order as ``gguf.quants.dequantize``, so the results are
    bit-identical to it (the tests check).
    """
    t = GGMLQuantizationType(ggml_type)
    with np.errstate(all="ignore"):      # a damaged scale is NaN / inf: a bad model, not a warning
        return _dequantize(raw, t).reshape(shape)


def _dequantize(raw: np.ndarray, t: GGMLQuantizationType) -> np.ndarray:
    if t == GGMLQuantizationType.F32:
        out = raw.view(np.float32).copy()
    elif t == GGMLQuantizationType.F16:
        out = raw.view(np.float16).astype(np.float32)
    elif t == GGMLQuantizationType.BF16:
        # bfloat16 is the top half of a float32: shift it back up.
        out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif t == GGMLQuantizationType.Q8_0:
        b = raw.reshape(-1, 34)
        out = b[:, 2:].view(np.int8).astype(np.float32)
        out *= _scale(b, 0)
    elif t == GGMLQuantizationType.Q4_0:
        b = raw.reshape(-1, 18)
        out = _nibbles(b[:, 2:])
        out -= 8.0
        out *= _scale(b, 0)
    elif t == GGMLQuantizationType.Q4_1:
        b = raw.reshape(-1, 20)
        out = _nibbles(b[:, 4:])
        out *= _scale(b, 0)
        out += _scale(b, 2)
    else:
        raise ModelLoadError(f"cannot dequantize type {t.name}; supported: {', '.join(SUPPORTED_TYPES)}")
    return out


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleaving of a Q or K projection (see the module docstring).

    ``w`` is ``[n_head * head_dim, in]``; rows ``(h, 2j)`` and ``(h, 2j+1)`` of the file go back to
    Hugging Face rows ``(h, j)`` and ``(h, j + head_dim/2)``.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelLoadError(f"cannot un-permute a Q/K weight of {rows} rows over {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation (the inverse of ``unpermute_qk``); used to write test files."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------------------------------
# Config and state dict
# --------------------------------------------------------------------------------------------------

def _require(md: dict[str, Any], key: str, path) -> Any:
    if key not in md:
        raise ModelLoadError(f"{path}: GGUF metadata lacks {key!r}, which a LLaMA model needs")
    return md[key]


def _int(md: dict[str, Any], key: str, path, default: Any = ...) -> Any:
    """An integer metadata value (``default`` if absent; required if no default)."""
    if default is not ... and key not in md:
        return default
    value = _require(md, key, path)
    if not _is_int(value):
        raise ModelLoadError(f"{path}: GGUF metadata {key!r} must be an integer, got "
                             f"{type(value).__name__} {_short(value)}")
    return value


def _float(md: dict[str, Any], key: str, path, default: float) -> float:
    value = md.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelLoadError(f"{path}: GGUF metadata {key!r} must be a number, got "
                             f"{type(value).__name__} {_short(value)}")
    if not math.isfinite(value):        # a float32 field holds inf / nan as easily as 1e-5
        raise ModelLoadError(f"{path}: GGUF metadata {key!r} must be a finite number, got {value}")
    return float(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def config_from_gguf(g: GGUFFile) -> ModelConfig:
    """Build a ``ModelConfig`` from the ``llama.*`` metadata keys. Raises ``ModelLoadError``."""
    md, path = g.metadata, g.path
    arch = md.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"unsupported architecture {arch!r} in {path}: minicb loads LLaMA-architecture "
                             "models only (general.architecture = 'llama')")
    scaling = md.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in g.tensors:
        raise ModelLoadError(f"{path}: RoPE scaling ({_short(scaling)}) is not supported; plain RoPE only")
    n_head = _int(md, "llama.attention.head_count", path)
    hidden = _int(md, "llama.embedding_length", path)
    rope_dim = _int(md, "llama.rope.dimension_count", path, None)
    head_dim = _int(md, "llama.attention.key_length", path, rope_dim)
    rope_dim = head_dim if rope_dim is None else rope_dim
    if head_dim is not None and rope_dim != head_dim:
        raise ModelLoadError(f"{path}: partial rotary embeddings (rope.dimension_count={rope_dim} < "
                             f"head_dim={head_dim}) are not supported")
    if "token_embd.weight" not in g.tensors:
        raise ModelLoadError(f"{path}: no tensor 'token_embd.weight'")
    vocab = _int(md, "llama.vocab_size", path, None)
    if vocab is None:
        vocab = g.tensors["token_embd.weight"].shape[0]
    try:
        return ModelConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_int(md, "llama.feed_forward_length", path),
            num_hidden_layers=_int(md, "llama.block_count", path),
            num_attention_heads=n_head,
            num_key_value_heads=_int(md, "llama.attention.head_count_kv", path, n_head),
            head_dim=head_dim,
            rope_theta=_float(md, "llama.rope.freq_base", path, 10000.0),
            rms_norm_eps=_float(md, "llama.attention.layer_norm_rms_epsilon", path, 1e-5),
            tie_word_embeddings="output.weight" not in g.tensors,
            max_position_embeddings=_int(md, "llama.context_length", path, 2048),
            bos_token_id=_int(md, "tokenizer.ggml.bos_token_id", path, None),
            eos_token_id=_int(md, "tokenizer.ggml.eos_token_id", path, None),
        )
    except InvalidArgument as e:
        raise ModelLoadError(f"{path}: inconsistent model shape in GGUF metadata: {e}") from e


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or ``None`` if it is not a LLaMA weight."""
    if gguf_name in _GLOBAL_NAME_MAP:
        return _GLOBAL_NAME_MAP[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAME_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_NAME_MAP[m.group(2)]}"
    return None


def state_dict_from_gguf(g: GGUFFile, config: ModelConfig, dtype: torch.dtype = torch.float32,
                         gguf_blocks: dict[str, np.ndarray] | None = None) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to ``dtype`` under its Hugging Face name, Q/K rows un-permuted.
    ``gguf_blocks``, a dict, also gets a copy of every Q4_1 and Q8_0 weight's blocks, ``[out, in / 32,
    20 or 34]`` bytes under the same name, rows un-permuted alike (``skinny_gemm.pack_blocks``)."""
    names = {}
    for name, info in g.tensors.items():
        target = hf_name(name)
        if target is None:
            raise ModelLoadError(f"{g.path}: unexpected tensor {_short(name)}; not part of a LLaMA model")
        try:
            type_name = GGMLQuantizationType(info.ggml_type).name
        except ValueError:
            type_name = f"unknown type {info.ggml_type}"
        if type_name not in SUPPORTED_TYPES:  # fail before spending time on the others
            raise ModelLoadError(f"{g.path}: tensor {_short(name)} has type {type_name}, which minicb cannot "
                                 f"dequantize; supported: {', '.join(SUPPORTED_TYPES)}")
        names[name] = target
    out: dict[str, torch.Tensor] = {}
    for name, target in names.items():
        info = g.tensors[name]
        w = dequantize(g.raw(name), info.ggml_type, info.shape)
        keep = gguf_blocks is not None and len(info.shape) == 2 and info.ggml_type in (
            GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)
        blocks = g.raw(name).reshape(info.shape[0], -1, GGML_QUANT_SIZES[info.ggml_type][1]) if keep else None
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if name.endswith("q.weight") else config.num_key_value_heads
            w = unpermute_qk(w, heads)
            blocks = None if blocks is None else unpermute_qk(blocks, heads)
        out[target] = _to_torch(w, dtype)
        if blocks is not None:
            gguf_blocks[target] = np.array(blocks, order="C")        # a copy: the file is closed after
    return out


def _to_torch(w: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A float32 array as a contiguous tensor of ``dtype`` (float32 -> float64 is exact).

    numpy does the float64 cast: on a small CPU it is several times faster here than ``Tensor.to``.
    """
    if dtype == torch.float32:
        return torch.from_numpy(np.ascontiguousarray(w))
    if dtype == torch.float64:
        return torch.from_numpy(w.astype(np.float64, order="C"))
    return torch.from_numpy(np.ascontiguousarray(w)).to(dtype)


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
              gguf_blocks: dict[str, np.ndarray] | None = None):
    """``(config, state_dict, metadata)`` of the GGUF at ``path``; the tokenizer is built by the caller.
    ``gguf_blocks``: filled with the Q4_1 and Q8_0 weights' blocks (``state_dict_from_gguf``)."""
    with read_gguf(path) as g:
        config = config_from_gguf(g)
        state_dict = state_dict_from_gguf(g, config, dtype, gguf_blocks)
        return config, state_dict, g.metadata
