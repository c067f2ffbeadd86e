"""Loader fuzzing: truncated, corrupted and wrong-typed GGUF files and safetensors directories give a
clear ``ModelLoadError``, never a crash of the interpreter, a hang or a huge allocation.

The tests write a tiny valid GGUF (``gguf.GGUFWriter``, quantized weights) and a tiny Hugging Face
directory (``config.json`` + ``model.safetensors`` + tokenizer), then derive many broken variants:

* truncated at many offsets (every header field boundary and spread over the data);
* every header field of the GGUF (string lengths, value and element types, array counts, numbers of
  keys and tensors, dimension counts, dimensions, tensor types and offsets) overwritten with huge and
  odd values, so the declared sizes no longer match the file;
* random bytes flipped in the header and in the tensor data;
* metadata / ``config.json`` values of the wrong type or absurd size (2**40 layers, 0 heads, ...);
* safetensors headers with huge or inconsistent lengths, offsets, shapes and dtypes, broken JSON,
  broken tokenizer files and shard indexes.

The bulk runs in a child process (``loader_fuzz_worker.py``) with a wall-clock timeout and a capped
data segment; each case must end in ``ok`` (the damage was harmless, e.g. flipped weight bytes) or
``ModelLoadError`` within seconds. A few cases are also checked in-process for their message.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass

import pytest

from minicb.core.errors import ModelLoadError
from minicb.model.weights.loader import load_model
from tiny_files import base_kv, hf_config, write_gguf, write_hf_dir

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # tests/
SRC = os.path.join(os.path.dirname(HERE), "src")

# GGUF value types (the format's numbering), for the walker below.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class Field:
    name: str
    pos: int
    size: int          # 4 or 8 bytes (little-endian unsigned)
    kind: str          # len, count, type, n_dims, dim, offset, scalar, version


def gguf_fields(data: bytes) -> tuple[list[Field], int]:
    """Walk a GGUF header independently of the loader: every length/count/type field and its offset.
    Returns the fields and where the header ends."""
    fields = [Field("version", 4, 4, "version"), Field("n_tensors", 8, 8, "count"),
              Field("n_kv", 16, 8, "count")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def u32(p):
        return struct.unpack_from("<I", data, p)[0]

    def u64(p):
        return struct.unpack_from("<Q", data, p)[0]

    def skip_value(vtype, p, label, record):
        if vtype == STRING:
            if record:
                fields.append(Field(f"{label}.len", p, 8, "len"))
            return p + 8 + u64(p)
        if vtype == ARRAY:
            etype, count = u32(p), u64(p + 4)
            if record:
                fields.extend([Field(f"{label}.etype", p, 4, "type"),
                               Field(f"{label}.count", p + 4, 8, "count")])
            p += 12
            if etype in _SCALAR_SIZES:
                return p + count * _SCALAR_SIZES[etype]
            for _ in range(count):
                p = skip_value(etype, p, label, False)
            return p
        if record:
            fields.append(Field(f"{label}.value", p, _SCALAR_SIZES[vtype], "scalar")
                          if _SCALAR_SIZES[vtype] in (4, 8) else Field(f"{label}.vtype", p - 4, 4, "type"))
        return p + _SCALAR_SIZES[vtype]

    def read_string(label: str, p: int) -> tuple[str, int]:
        """A length-prefixed GGUF string at ``p``: record its length field, return it and the end."""
        fields.append(Field(label, p, 8, "len"))
        return data[p + 8:p + 8 + u64(p)].decode(), p + 8 + u64(p)

    for _ in range(n_kv):
        key, pos = read_string("key.len", pos)
        fields.append(Field(f"{key}.vtype", pos, 4, "type"))
        vtype = u32(pos)
        pos = skip_value(vtype, pos + 4, key, True)
    for _ in range(n_tensors):
        name, pos = read_string("tensor.name.len", pos)
        fields.append(Field(f"{name}.n_dims", pos, 4, "n_dims"))
        n_dims = u32(pos)
        pos += 4
        for d in range(n_dims):
            fields.append(Field(f"{name}.dim{d}", pos, 8, "dim"))
            pos += 8
        fields += [Field(f"{name}.type", pos, 4, "type"), Field(f"{name}.offset", pos + 4, 8, "offset")]
        pos += 12
    return fields, pos


def overwrite(data: bytes, f: Field, value: int) -> bytes:
    value &= (1 << (8 * f.size)) - 1
    return data[:f.pos] + value.to_bytes(f.size, "little") + data[f.pos + f.size:]


def field_values(f: Field, file_size: int) -> list[int]:
    huge = [2**64 - 1, 2**63 + 5, 2**40, file_size + 1] if f.size == 8 else [2**32 - 1, 2**31]
    return {
        "len": huge + [0],
        "count": huge + [0],
        "dim": huge + [0, 3],
        "offset": huge + [1],
        "type": [2**32 - 1, 13, STRING, ARRAY, 0],
        "n_dims": [0, 5, 2**32 - 1],
        "scalar": [0, 2**(8 * f.size) - 1],
        "version": [1, 4, 2**32 - 1],
    }[f.kind]


def gguf_cases(tmp_path) -> list[str]:
    base = write_gguf(tmp_path / "base.gguf")
    data = base.read_bytes()
    fields, header_end = gguf_fields(data)
    rng = random.Random(1234)
    out = tmp_path / "gguf_cases"
    out.mkdir()
    cases: dict[str, bytes] = {}
    # truncations: at and just after every field, and spread over the rest of the file
    cuts = {0, 3, 4, 7, 8, 23, header_end - 1, header_end, len(data) - 1}
    cuts |= {f.pos + k for f in fields for k in (0, 1)}
    cuts |= {rng.randrange(header_end, len(data)) for _ in range(40)}
    for c in sorted(cuts):
        cases[f"cut{c}"] = data[:c]
    # every field, overwritten
    for i, f in enumerate(fields):
        for v in field_values(f, len(data)):
            cases[f"f{i}-{f.name}={v}"] = overwrite(data, f, v)
    # random flips: in the header, and in the tensor data
    for k in range(120):
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(4, header_end)] ^= 1 << rng.randrange(8)
        cases[f"hflip{k}"] = bytes(b)
    for k in range(15):
        b = bytearray(data)
        for _ in range(rng.randint(1, 64)):
            b[rng.randrange(header_end, len(data))] = rng.randrange(256)
        cases[f"dflip{k}"] = bytes(b)
    paths = []
    for name, blob in cases.items():
        p = out / (_safe(name) + ".gguf")
        p.write_bytes(blob)
        paths.append(str(p))
    # wrong-typed and absurd metadata, written properly
    from gguf import GGUFValueType as VT

    wrong = {
        "block_count_str": {"llama.block_count": ("1", VT.STRING)},
        "block_count_float": {"llama.block_count": (1.0, VT.FLOAT32)},
        "block_count_huge": {"llama.block_count": (2**40, VT.UINT64)},
        "block_count_zero": {"llama.block_count": (0, VT.UINT32)},
        "hidden_array": {"llama.embedding_length": ([32], VT.ARRAY, VT.UINT32)},
        "hidden_huge": {"llama.embedding_length": (2**40, VT.UINT64)},
        "heads_zero": {"llama.attention.head_count": (0, VT.UINT32)},
        "heads_huge": {"llama.attention.head_count": (2**31, VT.UINT32)},
        "kv_heads_3": {"llama.attention.head_count_kv": (3, VT.UINT32)},
        "ffn_missing": {"llama.feed_forward_length": None},
        "ctx_zero": {"llama.context_length": (0, VT.UINT32)},
        "rope_base_str": {"llama.rope.freq_base": ("big", VT.STRING)},
        "rope_base_negative": {"llama.rope.freq_base": (-1.0, VT.FLOAT32)},
        "rope_dim_odd": {"llama.rope.dimension_count": (15, VT.UINT32)},
        "eps_bool": {"llama.attention.layer_norm_rms_epsilon": (True, VT.BOOL)},
        "vocab_huge": {"llama.vocab_size": (2**40, VT.UINT64)},
        "vocab_str": {"llama.vocab_size": ("266", VT.STRING)},
        "alignment_zero": {"general.alignment": (0, VT.UINT32)},
        "alignment_str": {"general.alignment": ("32", VT.STRING)},
        "alignment_huge": {"general.alignment": (2**32 - 1, VT.UINT32)},
        "tokens_int": {"tokenizer.ggml.tokens": (list(range(266)), VT.ARRAY, VT.INT32)},
        "tokens_str": {"tokenizer.ggml.tokens": ("abc", VT.STRING)},
        "tokens_missing": {"tokenizer.ggml.tokens": None},
        "token_type_short": {"tokenizer.ggml.token_type": ([1, 1], VT.ARRAY, VT.INT32)},
        "merges_int": {"tokenizer.ggml.merges": ([1, 2, 3], VT.ARRAY, VT.INT32)},
        "merges_str": {"tokenizer.ggml.merges": ("a b", VT.STRING)},
        "merges_unknown": {"tokenizer.ggml.merges": (["zz qq", "x"], VT.ARRAY, VT.STRING)},
        "tokenizer_model_int": {"tokenizer.ggml.model": (5, VT.UINT32)},
        "pre_unknown": {"tokenizer.ggml.pre": ("klingon", VT.STRING)},
        "eos_str": {"tokenizer.ggml.eos_token_id": ("2", VT.STRING)},
        "eos_huge": {"tokenizer.ggml.eos_token_id": (2**31, VT.UINT32)},
        "bos_out_of_vocab_add": {"tokenizer.ggml.bos_token_id": (10_000, VT.UINT32),
                                 "tokenizer.ggml.add_bos_token": (True, VT.BOOL)},
        "template_int": {"tokenizer.chat_template": (7, VT.UINT32)},
        "template_bad_jinja": {"tokenizer.chat_template": ("{% for %}", VT.STRING)},
        "nested_arrays": {"x.nested": ([[1, 2], [3]], VT.ARRAY, VT.ARRAY)},
    }
    for name, kv in wrong.items():
        paths.append(str(write_gguf(out / f"kv_{name}.gguf", kv=kv)))
    return paths


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_=." else "_" for c in name)[:120]


# --- safetensors directories ----------------------------------------------------------------------
def st_split(blob: bytes) -> tuple[dict, bytes]:
    n = struct.unpack_from("<Q", blob)[0]
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def st_join(header, data: bytes, raw: bytes | None = None) -> bytes:
    h = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def hf_cases(tmp_path) -> list[str]:
    base = write_hf_dir(tmp_path / "hf_base")
    blob = (base / "model.safetensors").read_bytes()
    header, data = st_split(blob)
    hlen = 8 + struct.unpack_from("<Q", blob)[0]
    rng = random.Random(99)
    out = tmp_path / "hf_cases"
    out.mkdir()
    paths = []

    def case(name, st: bytes | None = None, config: dict | str | None = None, files: dict | None = None):
        d = out / f"{len(paths):03d}-{_safe(name)}"
        shutil.copytree(base, d)
        if st is not None:
            (d / "model.safetensors").write_bytes(st)
        if config is not None:
            (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
        for fname, content in (files or {}).items():
            if content is None:
                (d / fname).unlink()
            else:
                (d / fname).write_bytes(content if isinstance(content, bytes) else content.encode())
        paths.append(str(d))

    for c in sorted({0, 4, 7, 8, 9, hlen // 2, hlen - 1, hlen, hlen + 1, len(blob) - 1}
                    | {rng.randrange(hlen, len(blob)) for _ in range(10)}):
        case(f"st_cut{c}", blob[:c])
    for v in (0, 1, 2**64 - 1, 2**63, 2**40, len(blob), len(blob) - 8):
        case(f"st_hlen={v}", struct.pack("<Q", v) + blob[8:])
    first = next(k for k in header if k != "__metadata__")
    for label, change in [
        ("dtype_I64", {"dtype": "I64"}), ("dtype_BOOL", {"dtype": "BOOL"}), ("dtype_XX", {"dtype": "XX"}),
        ("dtype_int", {"dtype": 5}), ("shape_huge", {"shape": [2**40, 2**40]}),
        ("shape_overflow", {"shape": [2**63, 4]}), ("shape_negative", {"shape": [-1, 32]}),
        ("shape_empty", {"shape": []}), ("shape_str", {"shape": "266,32"}),
        ("offsets_huge", {"data_offsets": [0, 2**62]}), ("offsets_reversed", {"data_offsets": [34048, 0]}),
        ("offsets_negative", {"data_offsets": [-8, 34040]}), ("offsets_missing", {"data_offsets": None}),
    ]:
        h = json.loads(json.dumps(header))
        for k, v in change.items():
            if v is None:
                del h[first][k]
            else:
                h[first][k] = v
        case(f"st_{label}", st_join(h, data))
    h = json.loads(json.dumps(header))
    h["__metadata__"] = {"format": 5}
    case("st_metadata_int", st_join(h, data))
    case("st_header_not_json", st_join(None, data, raw=b"{" * 40))
    case("st_header_list", st_join(None, data, raw=b"[1, 2, 3]"))
    case("st_header_utf8", st_join(None, data, raw=b'{"\xff\xfe": 1}'))
    case("st_extra_data", blob + b"\0" * 64)
    for k in range(40):
        b = bytearray(blob)
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(0, hlen)] ^= 1 << rng.randrange(8)
        case(f"st_hflip{k}", bytes(b))
    for k in range(5):
        b = bytearray(blob)
        for _ in range(32):
            b[rng.randrange(hlen, len(blob))] = rng.randrange(256)
        case(f"st_dflip{k}", bytes(b))
    cfg = hf_config()
    for key, value in [("hidden_size", "32"), ("hidden_size", 2**40), ("hidden_size", 32.0),
                       ("hidden_size", None), ("hidden_size", [32]), ("num_hidden_layers", 2**40),
                       ("num_hidden_layers", -1), ("num_attention_heads", 0), ("num_key_value_heads", 3),
                       ("head_dim", 0), ("head_dim", "16"), ("vocab_size", 10), ("vocab_size", 2**40),
                       ("rope_theta", "x"), ("rope_theta", -5.0), ("rms_norm_eps", [1]),
                       ("architectures", 5), ("architectures", [5]), ("model_type", 5),
                       ("rope_scaling", "x"), ("rope_parameters", "x"), ("rope_parameters", [1]),
                       ("eos_token_id", "2"), ("eos_token_id", []), ("max_position_embeddings", 0),
                       ("max_position_embeddings", 2**70), ("hidden_act", 5), ("tie_word_embeddings", "no")]:
        case(f"cfg_{key}={value!r}"[:80], config={**cfg, key: value})
    case("cfg_list", config="[1, 2]")
    case("cfg_not_json", config="{")
    case("cfg_not_utf8", files={"config.json": b'{"a": "\xff"}'})
    for label, content in [("list", '{"weight_map": [1, 2]}'), ("outside", '{"weight_map": {"a": "../x"}}'),
                           ("abs", '{"weight_map": {"a": "/etc/passwd"}}'),
                           ("int", '{"weight_map": {"a": 5}}'),
                           ("missing_shard", '{"weight_map": {"a": "nope.safetensors"}}'),
                           ("no_map", "{}"), ("broken", "{")]:
        case(f"index_{label}", files={"model.safetensors.index.json": content})
    tj = (base / "tokenizer.json").read_bytes()
    case("tok_cut", files={"tokenizer.json": tj[: len(tj) // 2]})
    case("tok_garbage", files={"tokenizer.json": b"\x00\xff" * 100})
    case("tok_missing", files={"tokenizer.json": None})
    case("tokcfg_eos_int", files={"tokenizer_config.json": '{"eos_token": 5}'})
    case("tokcfg_eos_unknown", files={"tokenizer_config.json": '{"eos_token": "<nope>"}'})
    case("tokcfg_template_int", files={"tokenizer_config.json": '{"chat_template": 5}'})
    case("tokcfg_list", files={"tokenizer_config.json": "[1]"})
    case("tokcfg_not_utf8", files={"tokenizer_config.json": b'{"eos_token": "\xff"}'})
    return paths


# --- running the cases in a child process ----------------------------------------------------------
def run_worker(paths: list[str], tmp_path, timeout: float) -> list[dict]:
    listing = tmp_path / "cases.txt"
    listing.write_text("\n".join(paths) + "\n")
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run([sys.executable, os.path.join(HERE, "loader_fuzz_worker.py"), str(listing)],
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        lines = [json.loads(x) for x in (e.stdout or b"").decode().splitlines() if x.startswith("{")]
        started = [x["start"] for x in lines if "start" in x]
        pytest.fail(f"the loader hung (> {timeout} s in all) on {started[-1] if started else '?'}")
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    started = [x["start"] for x in lines if "start" in x]
    results = [x for x in lines if "case" in x]
    assert proc.returncode == 0, (f"the interpreter died (rc {proc.returncode}) on "
                                  f"{started[-1] if started else '?'}: {proc.stderr[-2000:]}")
    assert lines and lines[0].get("capped") in (True, False)
    assert [r["case"] for r in results] == paths
    return results


def check_results(results: list[dict], min_errors: int) -> None:
    bad = [r for r in results if r["outcome"] not in ("ok", "ModelLoadError")]
    assert not bad, f"{len(bad)} cases raised something else, e.g. {bad[:5]}"
    # A pathological case (a header claiming 2**40 tensors) shows as one case far slower than the rest:
    # measured against this run's own median, so a busy machine, which slows every case, cannot trip it.
    times = sorted(r["seconds"] for r in results)
    median = times[len(times) // 2]
    slow = [r for r in results if r["seconds"] > max(10.0, 200 * median)]
    # load-independent: a ratio to this run's own median
    assert not slow, f"cases took more than max(10 s, 200 x the median {median:.3f} s): {slow[:5]}"
    errors = [r for r in results if r["outcome"] == "ModelLoadError"]
    assert len(errors) >= min_errors, f"only {len(errors)} of {len(results)} cases were rejected"
    for r in errors:
        msg = r["message"]
        assert msg and "\n" not in msg and len(msg) < 600, r
    assert max(r["maxrss_mb"] for r in results) < 2048, "a case allocated far more than the file size"


@pytest.mark.timing
@pytest.mark.slow
def test_gguf_fuzz(tmp_path):
    paths = gguf_cases(tmp_path)
    assert len(paths) > 800
    results = run_worker(paths, tmp_path, timeout=600)
    check_results(results, min_errors=len(paths) // 2)
    by_name = {os.path.basename(r["case"]): r for r in results}
    for name in ("kv_block_count_huge.gguf", "kv_alignment_zero.gguf", "kv_tokens_int.gguf",
                 "kv_nested_arrays.gguf", "kv_block_count_str.gguf", "kv_hidden_huge.gguf"):
        assert by_name[name]["outcome"] in ("ModelLoadError", "ok"), by_name[name]
    assert by_name["kv_block_count_huge.gguf"]["outcome"] == "ModelLoadError"


@pytest.mark.timing
@pytest.mark.slow
def test_safetensors_fuzz(tmp_path):
    paths = hf_cases(tmp_path)
    assert len(paths) > 120
    results = run_worker(paths, tmp_path, timeout=600)
    check_results(results, min_errors=len(paths) // 2)


# --- a few cases in-process, for their messages -------------------------------------------------------
def load_error(path) -> str:
    with pytest.raises(ModelLoadError) as e:
        load_model(path)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_gguf_declared_sizes_are_checked_against_the_file(tmp_path):
    base = write_gguf(tmp_path / "base.gguf")
    data = base.read_bytes()
    fields, _ = gguf_fields(data)
    by = {f.name: f for f in fields}
    cases = {
        "n_tensors": (2**40, "declares 1099511627776 tensors"),
        "n_kv": (2**63, "metadata keys"),
        "tokenizer.ggml.tokens.count": (2**40, "array elements"),
        "tokenizer.chat_template.len": (2**40, "string bytes"),
        "token_embd.weight.dim1": (2**40, "past the end"),
        "token_embd.weight.offset": (2**64 - 1, "past the end"),
        "token_embd.weight.n_dims": (5, "at most 4"),
        "token_embd.weight.dim0": (33, "not a multiple"),
    }
    for name, (value, needle) in cases.items():
        p = tmp_path / f"{_safe(name)}.gguf"
        p.write_bytes(overwrite(data, by[name], value))
        msg = load_error(p)
        assert needle in msg and p.name in msg, (name, msg)


def test_gguf_wrong_typed_metadata_messages(tmp_path):
    from gguf import GGUFValueType as VT

    for name, kv, needles in [
        ("a", {"llama.block_count": ("1", VT.STRING)}, ["'llama.block_count' must be an integer", "str"]),
        ("b", {"llama.block_count": (2**40, VT.UINT64)}, ["weight(s) missing", "1099511627776 layers"]),
        ("c", {"general.alignment": (0, VT.UINT32)}, ["general.alignment must be a positive integer"]),
        ("d", {"llama.rope.freq_base": ("big", VT.STRING)}, ["'llama.rope.freq_base' must be a number"]),
        ("e", {"tokenizer.ggml.tokens": (list(range(266)), VT.ARRAY, VT.INT32)}, ["tokenizer"]),
        ("f", {"tokenizer.ggml.eos_token_id": (2**31, VT.UINT32)}, ["eos_token_id", "[0, 265]"]),
        ("g", {"llama.attention.head_count": (0, VT.UINT32)}, ["num_attention_heads", "[1, inf]"]),
    ]:
        msg = load_error(write_gguf(tmp_path / f"{name}.gguf", kv=kv))
        for needle in needles:
            assert needle in msg, (needle, msg)


def test_safetensors_and_config_messages(tmp_path):
    base = write_hf_dir(tmp_path / "base")
    blob = (base / "model.safetensors").read_bytes()
    header, data = st_split(blob)
    d = write_hf_dir(tmp_path / "int_weights")
    first = next(iter(header))
    h = json.loads(json.dumps(header))
    h[first]["dtype"] = "I32"
    (d / "model.safetensors").write_bytes(st_join(h, data))
    assert "floating point" in load_error(d)
    (d / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    assert "cannot read" in load_error(d) and "model.safetensors" in load_error(d)
    (d / "model.safetensors").write_bytes(blob)
    (d / "config.json").write_text(json.dumps({**hf_config(), "rope_theta": "x"}))
    assert "rope_theta must be a number" in load_error(d)
    (d / "config.json").write_text(json.dumps({**hf_config(), "num_hidden_layers": 2**40}))
    assert "weight(s) missing" in load_error(d)
    (d / "config.json").write_text(json.dumps(hf_config()))
    (d / "model.safetensors.index.json").write_text('{"weight_map": {"a": "../../etc/passwd"}}')
    assert "file names in the same directory" in load_error(d)


def test_base_files_load(tmp_path):
    """The fuzzers' starting points are valid (or every case would be a trivial error)."""
    a = load_model(write_gguf(tmp_path / "base.gguf"))
    b = load_model(write_hf_dir(tmp_path / "hf"))
    assert a.config.num_hidden_layers == b.config.num_hidden_layers == 1
    assert base_kv()["llama.block_count"][0] == 1


def test_gguf_header_claims_are_checked_against_the_data(tmp_path):
    """A header that parses but lies used to load and give garbage weights (issue 17, item 19): two
    tensors at one offset (aliased) or overlapping, a quantisation type swapped for one whose size
    does not match the bytes, a misaligned offset, a name declared twice, a NaN in the weights. The
    data section must be the tensors end to end with only alignment padding between them."""
    from gguf import GGMLQuantizationType as T

    base = write_gguf(tmp_path / "base.gguf")
    data = base.read_bytes()
    fields, _ = gguf_fields(data)
    by = {f.name: f for f in fields}

    def value(name: str) -> int:
        f = by[name]
        return int.from_bytes(data[f.pos:f.pos + f.size], "little")

    def tensor_of_type(t) -> str:
        return next(f.name[:-len(".type")] for f in fields if f.kind == "type" and f.name.endswith(".type")
                    and f.name[:-5] + ".offset" in by and value(f.name) == t)

    q8, q4 = tensor_of_type(T.Q8_0), tensor_of_type(T.Q4_0)
    embd, attn_norm = value("token_embd.weight.offset"), value("blk.0.attn_norm.weight.offset")
    norm = value("output_norm.weight.offset")
    cases = {
        "aliased": (overwrite(data, by["blk.0.ffn_norm.weight.offset"], attn_norm), "overlap"),
        "overlapping": (overwrite(data, by["blk.0.attn_norm.weight.offset"], embd + 64), "overlap"),
        "type_smaller": (overwrite(data, by[f"{q8}.type"], T.Q4_0), "bytes before the next tensor"),
        "type_larger": (overwrite(data, by[f"{q4}.type"], T.Q4_1), "overlap"),
        "misaligned": (overwrite(data, by["output_norm.weight.offset"], norm + 4),
                       "not a multiple of the alignment"),
    }
    k, q = by["blk.0.attn_k.weight.n_dims"].pos, by["blk.0.attn_q.weight.n_dims"].pos
    name_k, name_q = b"blk.0.attn_k.weight", b"blk.0.attn_q.weight"
    assert data[k - len(name_k):k] == name_k and data[q - len(name_q):q] == name_q
    cases["declared_twice"] = (data[:k - len(name_k)] + name_q + data[k:], "declared twice")
    for name, (blob, needle) in cases.items():
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(blob)
        msg = load_error(p)
        assert needle in msg and p.name in msg, (name, msg)


def test_gguf_non_finite_weights_are_refused(tmp_path):
    """A NaN or inf bit pattern over the first value of a float32 tensor (found through the header):
    the model used to load and compute NaN logits."""
    import struct as st

    from minicb.model.weights.gguf_loader import read_gguf

    base = write_gguf(tmp_path / "base.gguf")
    with read_gguf(base) as g:
        info = g.tensors["output_norm.weight"]
        assert info.type_name == "F32"
        offset = info.offset
    data = bytearray(base.read_bytes())
    for bits, name in ((0x7FC00000, "nan"), (0x7F800000, "inf")):
        data[offset:offset + 4] = st.pack("<I", bits)
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(bytes(data))
        msg = load_error(p)
        assert "model.norm.weight" in msg and "1 value(s) that are NaN or infinite" in msg, msg


def test_a_layer_of_nan_weights_is_refused_at_load_naming_the_tensor(tmp_path):
    """One layer's ``down_proj`` filled with NaN (issue 46): the model used to load, print an empty text
    and exit 0. Both formats, and a finite float32 value too large for float16 (it becomes inf in the
    cast), are refused in one line that names the tensor."""
    import numpy as np

    from tiny_files import tiny_weights

    weights = tiny_weights()
    weights["model.layers.0.mlp.down_proj.weight"][:] = np.nan
    name = "model.layers.0.mlp.down_proj.weight"
    n = weights[name].size
    for path in (write_gguf(tmp_path / "nan.gguf", weights, quantize=False),
                 write_hf_dir(tmp_path / "nan_hf", weights)):
        msg = load_error(path)
        assert name in msg and f"{n} value(s) that are NaN or infinite" in msg and "\n" not in msg, msg
    big = tiny_weights()
    big["model.layers.0.mlp.up_proj.weight"][0, 0] = 1e6          # finite in float32, inf in float16
    d = write_hf_dir(tmp_path / "big_hf", big)
    load_model(d)                                                  # float32: it loads
    with pytest.raises(ModelLoadError) as e:
        load_model(d, dtype=__import__("torch").float16)
    assert "model.layers.0.mlp.up_proj.weight" in str(e.value) and "float16" in str(e.value)


@pytest.mark.parametrize("key, value, needles", [
    ("llama.attention.layer_norm_rms_epsilon", float("inf"), ["layer_norm_rms_epsilon", "finite", "inf"]),
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), ["layer_norm_rms_epsilon", "finite", "nan"]),
    ("llama.attention.layer_norm_rms_epsilon", 2.0, ["rms_norm_eps", "[0.0, 1.0]"]),
    ("llama.attention.layer_norm_rms_epsilon", -1e-5, ["rms_norm_eps"]),
    ("llama.rope.freq_base", float("inf"), ["freq_base", "finite"]),
    ("llama.rope.freq_base", 0.5, ["rope_theta", "(1.0, 1000000000000.0]"]),
    ("llama.rope.freq_base", 1e30, ["rope_theta"]),
])
def test_gguf_metadata_numbers_out_of_range_are_refused(key, value, needles, tmp_path):
    from gguf import GGUFValueType as VT

    msg = load_error(write_gguf(tmp_path / "m.gguf", kv={key: (value, VT.FLOAT32)}))
    for needle in needles:
        assert needle in msg, (needle, msg)
