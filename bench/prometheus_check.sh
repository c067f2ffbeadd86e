#!/usr/bin/env bash
# Does vLLM's Grafana dashboard work on minicb serve? A real Prometheus scrapes a real server under
# load, and every expression of the dashboard's panels (tests/serve/data/vllm_grafana_exprs.json) is
# sent to Prometheus' HTTP API as Grafana would send it ($model_name and $__rate_interval filled in).
# It prints each expression's answer and how many of them returned data (a series with a finite
# value); it exits 1 if any returned none. A documented command, not part of CI:
#
#     bench/prometheus_check.sh                     # SmolLM2 (the installed model), 16 slots
#     MODEL=path/to/model.gguf bench/prometheus_check.sh
#
# Needs the prometheus binary on PATH (Debian / Ubuntu: apt-get install prometheus, or a release
# tarball from prometheus.io). Ports: PORT (minicb, default 8123) and PROM_PORT (default 9123).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PORT=${PORT:-8123}
PROM_PORT=${PROM_PORT:-9123}
NAME=${NAME:-smollm2}
REQUESTS=${REQUESTS:-48}
command -v prometheus >/dev/null || { echo "prometheus is not on PATH (apt-get install prometheus)" >&2; exit 2; }
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

python -m minicb serve ${MODEL:+--model "$MODEL"} --served-model-name "$NAME" --port "$PORT" \
    --max-num-seqs 16 --log-level warning >"$work/serve.log" 2>&1 &
pids+=($!)
cat >"$work/prometheus.yml" <<EOF
global: {scrape_interval: 1s, evaluation_interval: 1s}
scrape_configs:
  - job_name: minicb
    static_configs: [{targets: ["127.0.0.1:$PORT"]}]
EOF
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
    --web.listen-address="127.0.0.1:$PROM_PORT" >"$work/prometheus.log" 2>&1 &
pids+=($!)

python - "$PORT" "$PROM_PORT" "$NAME" "$REQUESTS" <<'EOF'
import concurrent.futures, json, math, sys, time, urllib.parse, urllib.request
port, prom_port, name, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
base, prom = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{prom_port}"

def get(url):
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())

def wait(what, ok, timeout=300):
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ok():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(1)

wait("minicb serve", lambda: get(base + "/health")["status"] == "ok")
wait("prometheus to scrape it", lambda: get(prom + "/api/v1/query?query=up")["data"]["result"][0]["value"][1] == "1")

def one(i):      # a shared system prompt (prefix-cache hits), prompts of many lengths, both endpoints
    path = "/v1/chat/completions" if i % 2 else "/v1/completions"
    body = {"model": name, "max_tokens": 8 + (i * 7) % 40, "temperature": 0.7, "seed": i}
    if i % 2:
        body["messages"] = [{"role": "system", "content": "You answer in one short sentence. " * 8},
                            {"role": "user", "content": f"Question {i}: " + "why? " * (i % 9)}]
    else:
        body["prompt"] = "Once upon a time, " * (1 + i % 12)
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["usage"]["completion_tokens"]

t0 = time.monotonic()
with concurrent.futures.ThreadPoolExecutor(24) as pool:
    tokens = sum(pool.map(one, range(n)))
print(f"load: {n} requests, {tokens} tokens generated in {time.monotonic() - t0:.1f} s")
time.sleep(4)                                   # a few more scrapes after the last request

doc = json.load(open("tests/serve/data/vllm_grafana_exprs.json"))
with_data = total = 0
for panel in doc["panels"]:
    for expr in panel["exprs"]:
        q = expr.replace("$model_name", name).replace("$__rate_interval", "2m")
        res = get(prom + "/api/v1/query?" + urllib.parse.urlencode({"query": q}))
        assert res["status"] == "success", res
        values = [float(r["value"][1]) for r in res["data"]["result"]]
        finite = [v for v in values if math.isfinite(v)]
        total += 1
        with_data += bool(finite)
        shown = ", ".join(f"{v:.4g}" for v in finite[:3]) + (" ..." if len(finite) > 3 else "")
        print(f"{'ok  ' if finite else 'NONE'} {panel['title']:<40} {len(values):>2} series  {shown}")
print(f"{with_data} of {total} dashboard expressions returned data")
sys.exit(0 if with_data == total else 1)
EOF
