"""vLLM's own Grafana dashboard reads ``minicb serve``: every metric its panels query is on ``/metrics``
after a few requests, with vLLM's type, labels and buckets, and with data; the per-request histograms
and the prefix-cache counters hold exactly what the requests did.

The expressions are those of vLLM's example dashboard (``data/vllm_grafana_exprs.json`` says where
from); ``bench/prometheus_check.sh`` runs each of them through a real Prometheus. The expected values
come from the clients' own ``usage`` and from the engine's ``RequestOutput`` timestamps (captured
beside the server), and the expected buckets are written out by hand.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from minicb.entrypoints.serve.metrics import buckets_1_2_5
from serve_helpers import MODEL, client, http, running_server
from tiny_files import write_gguf

DATA = pathlib.Path(__file__).parent / "data" / "vllm_grafana_exprs.json"
BLOCK = 4
SMALL = dict(max_num_seqs=4, num_blocks=64, block_size=BLOCK, max_num_batched_tokens=32)
NEW_HISTOGRAMS = ("vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                  "vllm:request_max_num_generation_tokens", "vllm:request_prefill_time_seconds",
                  "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds")


def dashboard_exprs() -> list[str]:
    return [e for p in json.loads(DATA.read_text())["panels"] for e in p["exprs"]]


def queried_series(exprs) -> set[str]:
    """The series names the expressions select (``vllm:..._bucket``, ``..._total``, a gauge)."""
    return {m for e in exprs for m in re.findall(r"vllm:[A-Za-z0-9_:]+", e)}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    finished = []

    def hook(engine):                 # keep every finished RequestOutput: the timestamps' oracle
        inner = engine.step

        def step():
            outs = inner()
            finished.extend(o for o in outs if o.finished)
            return outs
        engine.step = step

    gguf = write_gguf(tmp_path_factory.mktemp("dash") / "tiny.gguf")
    with running_server(gguf, engine_hook=hook, **SMALL) as (server, url):
        yield server, url, finished


def scrape(url: str) -> dict:
    """``{family name: family}`` of ``/metrics``, parsed by prometheus_client's own parser."""
    status, _, text = http("GET", url + "/metrics")
    assert status == 200
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(fams: dict) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}


def value(sam: dict, name: str, **labels) -> float:
    return sam.get((name, tuple(sorted({"model_name": MODEL, **labels}.items()))), 0.0)


def test_the_dashboard_is_the_one_described():
    doc = json.loads(DATA.read_text())
    assert "vllm-project/vllm" in doc["source"] and doc["licence"].startswith("Apache-2.0")
    assert len(doc["panels"]) == 12 and len(dashboard_exprs()) == 27
    assert all('model_name="$model_name"' in e for e in dashboard_exprs())


def test_1_2_5_buckets_are_vllms():
    assert buckets_1_2_5(4096) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert buckets_1_2_5(5000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
    assert buckets_1_2_5(1) == (1,)


def test_every_metric_the_dashboard_queries_exists_with_data(served):
    _, url, _ = served
    c = client(url)
    for i in range(4):
        c.completions.create(model=MODEL, prompt=[7 + i] * (5 + 3 * i), max_tokens=4 + i, temperature=0,
                             extra_body={"ignore_eos": True})
    fams = scrape(url)
    sam = samples(fams)
    names = {name for name, _ in sam}
    wanted = queried_series(dashboard_exprs())
    assert len(wanted) == 21, sorted(wanted)
    missing = sorted(wanted - names)
    assert missing == [], missing
    gauges = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
    for series in sorted(wanted):
        got = {labels: v for (n, labels), v in sam.items() if n == series}
        assert all(dict(labels)["model_name"] == MODEL for labels in got), series
        if series in gauges:
            assert len(got) == 1, series                            # present (idle now: 0 is its value)
        elif series.endswith("_bucket"):
            inf = [v for labels, v in got.items() if dict(labels)["le"] == "+Inf"]
            assert inf and inf[0] >= 4, series                      # the four requests, at least
        else:
            assert sum(got.values()) > 0, series                    # a counter or a histogram's _sum
    for h in NEW_HISTOGRAMS:                                        # vLLM's type, labels and buckets
        fam = fams[h]
        assert fam.type == "histogram", h
        labels = {k for s in fam.samples for k in s.labels}
        assert labels == {"model_name", "le"}, (h, labels)
    le = [float(s.labels["le"]) for s in fams["vllm:request_prompt_tokens"].samples
          if s.name.endswith("_bucket")]
    # load-independent: bucket bounds (max_model_len 4096), not a measured time
    assert le == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, float("inf")]
    le = [float(s.labels["le"]) for s in fams["vllm:request_prefill_time_seconds"].samples
          if s.name.endswith("_bucket")]
    # load-independent: vLLM's request-latency bucket bounds, not a measured time
    assert le[:4] == [0.3, 0.5, 0.8, 1.0] and le[-2:] == [7680.0, float("inf")]
    for counter in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
        assert fams[counter].type == "counter"


def test_the_per_request_histograms_hold_what_the_requests_did(served):
    _, url, finished = served
    before = samples(scrape(url))
    already = len(finished)
    c = client(url)
    shapes = [(3, 2), (9, 7), (25, 1), (60, 30)]                    # (prompt tokens, max_tokens)
    usages = [c.completions.create(model=MODEL, prompt=[40 + k] * p, max_tokens=n, temperature=0,
                                   extra_body={"ignore_eos": True}).usage for k, (p, n) in enumerate(shapes)]
    after = samples(scrape(url))
    outs = finished[already:]
    assert len(outs) == 4

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    prompts = [u.prompt_tokens for u in usages]
    generated = [u.completion_tokens for u in usages]
    assert prompts == [3, 9, 25, 60] and generated == [2, 7, 1, 30]
    for name, sizes in (("vllm:request_prompt_tokens", prompts),
                        ("vllm:request_generation_tokens", generated),
                        ("vllm:request_max_num_generation_tokens", generated)):
        assert delta(name + "_count") == 4 and delta(name + "_sum") == sum(sizes), name
        for le in (1, 2, 5, 10, 20, 50, 100):                       # each request in its bucket
            assert delta(name + "_bucket", le=f"{float(le)}") == sum(s <= le for s in sizes), (name, le)
    prefill = sum(o.first_token_time - o.first_scheduled_time for o in outs)
    decode = sum(o.token_times[-1] - o.first_token_time for o in outs)
    inference = sum(o.token_times[-1] - o.first_scheduled_time for o in outs)
    # load-independent: the metrics and the oracle read the same recorded timestamps; "> 0" only grows
    assert delta("vllm:request_prefill_time_seconds_sum") == pytest.approx(prefill, rel=1e-9, abs=1e-12)
    # load-independent: the same recorded timestamps
    assert delta("vllm:request_decode_time_seconds_sum") == pytest.approx(decode, rel=1e-9, abs=1e-12)
    # load-independent: the same recorded timestamps
    assert delta("vllm:request_inference_time_seconds_sum") == pytest.approx(inference, rel=1e-9, abs=1e-12)
    assert inference == pytest.approx(prefill + decode)  # load-independent: an identity
    assert decode > 0 and prefill > 0              # load-independent: every phase took time (load only adds)
    for name in ("prefill", "decode", "inference"):
        assert delta(f"vllm:request_{name}_time_seconds_count") == 4  # load-independent: a count


def test_prefix_cache_counters_count_first_admissions(served):
    _, url, _ = served
    c = client(url)
    prompt = [200 + i % 50 for i in range(21)]                      # 5 full blocks of 4 and 1 token
    before = samples(scrape(url))
    for _ in range(2):                                              # one after the other
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    after = samples(scrape(url))

    def delta(name):
        return value(after, name) - value(before, name)

    assert delta("vllm:prefix_cache_queries_total") == 2 * 21
    # the second finds the first's 5 full blocks; a hit always leaves one token to compute
    assert delta("vllm:prefix_cache_hits_total") == 5 * BLOCK
