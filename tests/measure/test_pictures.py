"""The docs' pictures (``minicb.measure.pictures``): their data is what the code computes, each committed
picture was drawn from the committed data, and the data says what the picture claims.

The ragged mask is checked twice, independently of the function that drew it: against a mask derived
from the plan's rows alone (positions, no cu_seqlens), and numerically against the attention the model
really runs (the reference backend reading the paged cache), by dense attention under the picture's mask.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from minicb.measure import pictures
from preconditions import unavailable

ROOT = pathlib.Path(__file__).resolve().parents[2]
IMAGES = ROOT / "docs" / "images"


def _needs_matplotlib() -> None:
    """matplotlib draws the images: locally its absence skips (with the reason), in CI it fails
    (``make setup`` installs the dev extra), so a skip cannot pass for a drawn image there."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        unavailable("matplotlib is in the plots and dev extras: pip install -e '.[dev]'")


def _committed(name: str) -> dict:
    return json.loads((IMAGES / f"{name}.json").read_text())


def _mask_from_rows(seqs: list[dict]) -> list[str]:
    """Row = (sequence, query i) at position start + i, column = (sequence, key position j), packed in
    plan order; allowed iff same sequence and j <= start + i. Built from the rows, not from offsets."""
    cols = [(b, j) for b, s in enumerate(seqs) for j in range(s["start_pos"] + s["num_tokens"])]
    rows = [(b, s["start_pos"] + i) for b, s in enumerate(seqs) for i in range(s["num_tokens"])]
    return ["".join("1" if cb == rb and j <= p else "0" for cb, j in cols) for rb, p in rows]


def test_committed_mask_equals_a_mask_computed_independently():
    data = _committed("ragged-mask")
    assert data["mask"] == _mask_from_rows(data["seqs"])
    # the step is the one the picture promises: decodes beside a chunk that follows cached tokens
    kinds = [(s["num_tokens"] == 1, s["start_pos"] > 0) for s in data["seqs"]]
    assert sum(d for d, _ in kinds) >= 2 and any(not d and late for d, late in kinds)
    chunk = next(s for s in data["seqs"] if s["num_tokens"] > 1)
    # bottom-right: the chunk's last query sees all its keys, its first sees start_pos + 1 of them
    b = data["seqs"].index(chunk)
    q0, k0 = data["cu_seqlens_q"][b], data["cu_seqlens_k"][b]
    width = chunk["start_pos"] + chunk["num_tokens"]
    assert data["mask"][q0][k0:k0 + width].count("1") == chunk["start_pos"] + 1
    assert data["mask"][q0 + chunk["num_tokens"] - 1][k0:k0 + width] == "1" * width


def test_mask_is_the_attention_the_model_runs():
    """Random q/k/v through the reference backend over a real paged cache equal dense attention under
    the picture's mask: the picture shows exactly which keys each packed query reads."""
    from minicb.model.attention import ReferenceAttention
    from minicb.model.kv_cache import KVCache
    from minicb.runtime.packer import pack

    plan, _ = pictures.mixed_step()
    data = pictures.mask_data(plan)
    assert data["mask"] == _committed("ragged-mask")["mask"]          # the committed data is current
    g = torch.Generator().manual_seed(0)
    d, bs = 8, plan.block_size
    cache = KVCache(1, 16, bs, 1, d, torch.float64)
    batch = pack(plan)
    n = batch.num_tokens
    # the cached keys/values of earlier positions, written where each sequence's table puts them
    old_k, old_v = {}, {}
    for s in plan.seqs:
        for p in range(s.start_pos):
            slot = s.block_table[p // bs] * bs + p % bs
            old_k[s.request_id, p] = torch.randn(1, d, generator=g, dtype=torch.float64)
            old_v[s.request_id, p] = torch.randn(1, d, generator=g, dtype=torch.float64)
            cache.write(0, old_k[s.request_id, p][None], old_v[s.request_id, p][None], torch.tensor([slot]))
    q, k, v = (torch.randn(n, 1, d, generator=g, dtype=torch.float64) for _ in range(3))
    backend = ReferenceAttention(cache)
    out = backend.attend(0, q, k, v, backend.prepare(batch.attn))
    # dense: every key of every sequence in cu_seqlens_k order, masked by the picture
    keys, vals, t = [], [], 0
    for s in plan.seqs:
        for p in range(s.start_pos + s.num_tokens):
            if p < s.start_pos:
                keys.append(old_k[s.request_id, p][0])
                vals.append(old_v[s.request_id, p][0])
            else:
                keys.append(k[t + p - s.start_pos, 0])
                vals.append(v[t + p - s.start_pos, 0])
        t += s.num_tokens
    kk, vv = torch.stack(keys), torch.stack(vals)
    allowed = torch.tensor([[c == "1" for c in row] for row in data["mask"]])
    scores = (q[:, 0] @ kk.T) / d ** 0.5
    dense = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ vv
    torch.testing.assert_close(out[:, 0], dense, rtol=1e-10, atol=1e-10)


def test_block_table_picture_data_follows_the_tables():
    data = _committed("block-tables")
    bs, t = data["block_size"], 0
    for s in data["seqs"]:
        for p in range(s["start_pos"], s["start_pos"] + s["num_tokens"]):
            assert data["positions"][t] == p
            assert data["slot_mapping"][t] == s["block_table"][p // bs] * bs + p % bs
            assert data["owners"][s["block_table"][p // bs]] == s["request_id"]
            t += 1
    assert t == len(data["slot_mapping"]) and len(set(data["slot_mapping"])) == t   # no slot written twice


def test_prefix_tree_data_matches_the_prompts():
    data = _committed("prefix-tree")
    bs, prompts = data["block_size"], data["prompts"]

    def shared_blocks(a: list[int], b: list[int]) -> int:
        """Full blocks two prompts have in common from the start."""
        n = 0
        while (n + 1) * bs <= min(len(a), len(b)) and a[n * bs:(n + 1) * bs] == b[n * bs:(n + 1) * bs]:
            n += 1
        return n

    order = list(prompts)
    for i, rid in enumerate(order):
        # hits: the longest prefix shared with an earlier request, never the last token
        expect = max([shared_blocks(prompts[rid], prompts[r]) for r in order[:i]] + [0])
        assert len(data["hits"][rid]) == min(expect, (len(prompts[rid]) - 1) // bs), rid
    nodes = {n["block"]: n for n in data["nodes"]}
    freed = data["freed"]
    for rid, table in data["tables"].items():        # full blocks are cached, and hold their tokens
        for i, block in enumerate(table[: len(prompts[rid]) // bs]):
            assert nodes[block]["tokens"] == prompts[rid][i * bs:(i + 1) * bs]
            assert nodes[block]["parent"] == (table[i - 1] if i else None)
            if rid != freed:
                assert rid in nodes[block]["holders"]
    for block, n in nodes.items():                  # ref count = the live tables that name it
        assert n["ref_count"] == sum(block in t for r, t in data["tables"].items() if r != freed)
        assert (n["lru"] is None) == (n["ref_count"] > 0)
    lookup = data["lookup"]
    assert lookup["tokens"][: len(prompts[freed])] == prompts[freed]
    assert lookup["hits"] == data["tables"][freed][: len(prompts[freed]) // bs]   # the freed blocks, re-hit


def test_policies_picture_shares_arrivals_and_requests():
    data = _committed("policies")
    w = data["workload"]
    expected = {f"r{i}": i * w["arrival_gap"] for i in range(w["num_requests"])}
    for policy, trace in data["traces"].items():
        # load-independent: arrivals in steps of a committed trace
        assert trace["arrivals"] == expected, policy             # arrivals in steps, as the workload says
        assert sorted(trace["request_ids"]) == sorted(expected), policy  # load-independent: request ids
        first = {}
        for t, step in enumerate(trace["cells"]):
            for kind, rid, _, _ in step:
                if kind in "PD":
                    first.setdefault(rid, t)
        # load-independent: steps of a committed trace
        assert all(first[r] >= expected[r] for r in expected), policy   # nobody runs before it arrives
    waste = {p: trace["summary"]["padding_waste"] for p, trace in data["traces"].items()}
    assert waste["static"] > 0 and waste["dynamic"] > 0 and waste["continuous"] == 0


@pytest.mark.slow
def test_committed_pictures_are_current_and_redraw_the_same(tmp_path):
    _needs_matplotlib()
    import matplotlib

    assert pictures.check(IMAGES) == [], "run: make docs-pages (or python -m minicb.measure.pictures)"
    for name in pictures.NAMES:
        data = _committed(name)
        svg = tmp_path / f"{name}.svg"
        pictures.draw(name, data, str(svg))
        committed = (IMAGES / f"{name}.svg").read_text()
        assert pictures.svg_data_hash(svg.read_text()) == pictures.svg_data_hash(committed)
        if f"Matplotlib v{matplotlib.__version__}" in committed:    # same drawing library: same bytes
            assert svg.read_text() == committed, name


def test_check_reports_stale_pictures(tmp_path, monkeypatch):
    fake = {"ragged-mask": {"mask": ["1"]}}
    monkeypatch.setattr(pictures, "compute_all", lambda: fake)
    (tmp_path / "ragged-mask.json").write_text(pictures.to_json(fake["ragged-mask"]))
    (tmp_path / "ragged-mask.svg").write_text("<svg>data sha256 " + "0" * 64 + "</svg>")
    assert pictures.check(tmp_path) == [f"{tmp_path / 'ragged-mask.svg'}: not drawn from the current data"]
    (tmp_path / "ragged-mask.json").write_text("{}")
    assert len(pictures.check(tmp_path)) == 2
