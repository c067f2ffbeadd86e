"""``GET /metrics``: Prometheus metrics under vLLM's names, so vLLM's dashboards read minicb.

Where vLLM (V1) has a metric for a concept, minicb uses its name, type, help text, buckets and
``model_name`` label (the tables below). The phases are vLLM V1's (``vllm/v1/metrics/stats.py``):
*queued* from arrival to the first time the scheduler gives the request a slot, *prefill* from then
to its first token, *decode* from the first token to the last, *inference* the two together; a
request preempted and run again keeps its first schedule. The prefix-cache counters count a
request's *first* admission, as vLLM's do, from the scheduler's running totals
(``SchedulerStats.num_prompt_tokens`` / ``num_cached_prompt_tokens``), read once per step.

The gauges and per-step figures come from the engine's step events (``on_step``); the per-request
figures from the outputs the engine thread hands on (``observe_tokens`` / ``observe_finished``: a
few additions per request). All of it runs on the engine thread; prometheus_client is thread-safe,
so the event loop renders ``/metrics`` at any time. Each server has its own registry (tests run
several servers in one process).
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from minicb.engine.events import StepEvent
from minicb.engine.outputs import RequestOutput

# vLLM's buckets (vllm/v1/metrics/loggers.py), so the histograms line up with its dashboards
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, ... up to ``max_value`` (inclusive)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10

CONTENT_TYPE = CONTENT_TYPE_LATEST

# attribute: (vLLM's name, vLLM's help text[, buckets: None is vLLM's 1-2-5 up to max_model_len])
_GAUGES = {
    "running": ("vllm:num_requests_running", "Number of requests in the running batch."),
    "waiting": ("vllm:num_requests_waiting", "Number of requests waiting to be scheduled."),
    "swapped": ("vllm:num_requests_swapped", "Number of requests swapped out to host memory."),
    "kv_usage": ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")}
_COUNTERS = {
    "preemptions": ("vllm:num_preemptions", "Cumulative number of preemptions."),
    "prompt_tokens": ("vllm:prompt_tokens", "Number of prefill tokens processed."),
    "generation_tokens": ("vllm:generation_tokens", "Number of generation tokens processed."),
    "prefix_queries": ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
                       "tokens."),
    "prefix_hits": ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")}
_HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
             TTFT_BUCKETS),
    "itl": ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    "e2e": ("vllm:e2e_request_latency_seconds", "Histogram of end-to-end request latency in seconds.",
            REQUEST_BUCKETS),
    "queue_time": ("vllm:request_queue_time_seconds", "Histogram of time spent waiting before the first "
                   "step in seconds.", REQUEST_BUCKETS),
    "iteration_tokens": ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine step.",
                         TOKEN_BUCKETS),
    "prefill_time": ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for "
                     "request.", REQUEST_BUCKETS),
    "decode_time": ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for "
                    "request.", REQUEST_BUCKETS),
    "inference_time": ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for "
                       "request.", REQUEST_BUCKETS),
    "request_prompt_tokens": ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", None),
    "request_generation_tokens": ("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                  None),
    "max_generation_tokens": ("vllm:request_max_num_generation_tokens", "Histogram of maximum number of "
                              "requested generation tokens.", None)}


class ServerMetrics:
    """The server's Prometheus metrics; ``render()`` is the ``/metrics`` body."""

    def __init__(self, model_name: str, max_model_len: int = 8192) -> None:
        disable_created_metrics()     # no ``*_created`` series (process-wide, as vLLM does)
        self.registry = CollectorRegistry()
        r, labels, name = self.registry, ["model_name"], {"model_name": model_name}

        def gauge(metric: str, doc: str):
            return Gauge(metric, doc, labels, registry=r).labels(**name)

        def counter(metric: str, doc: str):
            return Counter(metric, doc, labels, registry=r).labels(**name)

        def histogram(metric: str, doc: str, buckets):
            return Histogram(metric, doc, labels, buckets=buckets, registry=r).labels(**name)

        for attr, (metric, doc) in _GAUGES.items():
            setattr(self, attr, gauge(metric, doc))
        for attr, (metric, doc) in _COUNTERS.items():
            setattr(self, attr, counter(metric, doc))
        lengths = buckets_1_2_5(max_model_len)
        for attr, (metric, doc, buckets) in _HISTOGRAMS.items():
            setattr(self, attr, histogram(metric, doc, buckets or lengths))
        self._success = Counter("vllm:request_success", "Count of finished requests.",
                                labels + ["finished_reason"], registry=r)
        self._model_name = model_name
        self._stats = None                      # the scheduler's SchedulerStats (watch_stats)
        self._queried = self._hit = 0           # its prefix-cache totals already counted

    # --- from step events -------------------------------------------------------------------------
    def watch_stats(self, stats) -> None:
        """Read the prefix-cache totals of ``stats`` (the engine's live ``SchedulerStats``) each step."""
        self._stats = stats
        self._queried, self._hit = stats.num_prompt_tokens, stats.num_cached_prompt_tokens

    def on_step(self, event: StepEvent) -> None:
        self.observe_state(event.after)
        st = self._stats
        if st is not None and st.num_prompt_tokens != self._queried:
            self.prefix_queries.inc(st.num_prompt_tokens - self._queried)
            self.prefix_hits.inc(st.num_cached_prompt_tokens - self._hit)
            self._queried, self._hit = st.num_prompt_tokens, st.num_cached_prompt_tokens
        if event.plan.preempted:
            self.preemptions.inc(len(event.plan.preempted))
        if event.plan.num_batched_tokens:
            self.iteration_tokens.observe(event.plan.num_batched_tokens)

    def observe_state(self, snap) -> None:
        """The gauges from a ``SchedulerSnapshot``."""
        self.running.set(len(snap.running))
        self.waiting.set(len(snap.waiting))
        self.swapped.set(len(snap.swapped))
        self.kv_usage.set(snap.num_used_blocks / snap.num_blocks if snap.num_blocks else 0.0)

    # --- from the outputs ---------------------------------------------------------------------------
    def observe_tokens(self, out: RequestOutput, first: bool) -> None:
        """A step's output of one request: its new tokens, every choice's (``n > 1``: each child's count,
        as vLLM counts each of them), ``first``: the request's first ones."""
        k = sum(len(c.new_token_ids) for c in out.outputs) if len(out.outputs) > 1 else len(out.new_token_ids)
        if not k:
            return
        self.generation_tokens.inc(k)
        times = out.token_times
        if first:
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            if out.first_token_time is not None:
                self.ttft.observe(max(0.0, out.first_token_time - out.arrival_time))
        for i in range(max(1, len(times) - k), len(times)):
            self.itl.observe(max(0.0, times[i] - times[i - 1]))

    def observe_finished(self, out: RequestOutput, reason: str | None) -> None:
        self._success.labels(model_name=self._model_name, finished_reason=reason or "abort").inc()
        if out.finish_time is not None:
            self.e2e.observe(max(0.0, out.finish_time - out.arrival_time))
        scheduled, first = out.first_scheduled_time, out.first_token_time
        if scheduled is not None:
            self.queue_time.observe(max(0.0, scheduled - out.arrival_time))
        if first is not None:                 # it got a token (an abort in the queue did not)
            last = out.token_times[-1] if out.token_times else first
            if scheduled is not None:
                self.prefill_time.observe(max(0.0, first - scheduled))
                self.inference_time.observe(max(0.0, last - scheduled))
            self.decode_time.observe(max(0.0, last - first))
        n = len(out.token_ids)
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(n)
        self.max_generation_tokens.observe(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
