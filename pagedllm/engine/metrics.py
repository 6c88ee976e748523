"""What the AsyncLLMEngine measures per loop pass (`IterationStats`, `FinishedRequestStats`) and
the stat loggers it feeds: a periodic log line and Prometheus metrics.

Both are fed on the engine thread by `AsyncLLMEngine` after every loop pass with the engine's
`get_stats()` (gauges and cumulative counters) and the loop's `IterationStats` (latencies of
first tokens, inter-token gaps, finished requests). Metric names and meanings follow vLLM's,
with the prefix `pagedllm:`; every metric carries the label `model_name`.

prometheus_client is imported only when a PrometheusStatLogger is built, so this module (and
the offline engine) stay importable without it. Each server passes its own CollectorRegistry:
never the global one, so two servers (or tests) can live in one process.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class IterationStats:
    """What happened in one pass of the engine loop, for the stat loggers."""

    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)  # tokens of each step scheduled


@dataclass(slots=True)
class FinishedRequestStats:
    finish_reasons: list[str]  # one per sample (n): stop | length | abort | error
    e2e_latency: float  # seconds from generate() to the end
    time_to_first_token: float | None
    time_per_output_token: float | None  # (end - first token) / (tokens - 1)
    queue_time: float | None  # arrival in the engine to first scheduling
    num_prompt_tokens: int
    num_generation_tokens: int
    prefill_time: float | None = None  # first scheduling to first token (engine clock)
    decode_time: float | None = None  # first token to last token
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache


class StatLogger(Protocol):
    """Called on the engine thread after every loop pass (and about once a second when idle).
    `stats` is what `LLMEngine.get_stats()` returned (None if it failed)."""

    def record(self, stats: Any, iteration: IterationStats, now: float) -> None: ...


def finished_request_stats(state: Any, out: Any, now: float, reason: str | None) -> FinishedRequestStats:
    """The stats of a request that ended: `state` is the AsyncLLMEngine's record of it (arrival,
    first-token time, token counts), `out` its last RequestOutput (None if it never had one);
    `reason` fills in for samples without a finish reason of their own (abort, error)."""
    fallback = reason or "stop"
    if reason == "error" or out is None:
        reasons = [fallback] * max(1, len(state.outputs))
    else:
        reasons = [c.finish_reason or fallback for c in out.outputs] or [fallback]
    m = out.metrics if out is not None else None
    ttft = tpot = None
    if not state.final_only:
        if state.first_token_time is not None:
            ttft = state.first_token_time - state.arrival
            if state.num_tokens > 1:
                tpot = (now - state.first_token_time) / (state.num_tokens - 1)
    elif m is not None and m.first_token_time is not None:
        # only the engine saw the first token (on the same clock: m.arrival_time is state.arrival)
        ttft = m.first_token_time - state.arrival
        if state.num_tokens > 1 and m.last_token_time is not None:
            tpot = (m.last_token_time - m.first_token_time) / (state.num_tokens - 1)
    queue_time = None
    if m is not None:
        if m.time_in_queue is not None:
            queue_time = m.time_in_queue
        elif m.first_scheduled_time is not None:
            queue_time = max(0.0, m.first_scheduled_time - m.arrival_time)
    prefill_time = decode_time = None
    if m is not None and m.first_token_time is not None:
        if m.first_scheduled_time is not None:
            prefill_time = max(0.0, m.first_token_time - m.first_scheduled_time)
        if m.last_token_time is not None:
            decode_time = max(0.0, m.last_token_time - m.first_token_time)
    return FinishedRequestStats(
        prefill_time=prefill_time,
        decode_time=decode_time,
        num_cached_tokens=out.num_cached_tokens if out is not None else 0,
        finish_reasons=reasons,
        e2e_latency=now - state.arrival,
        time_to_first_token=ttft,
        time_per_output_token=tpot,
        queue_time=queue_time,
        num_prompt_tokens=state.num_prompt_tokens,
        num_generation_tokens=state.num_tokens,
    )


# Cumulative counters in the engine's stats object and the metric each feeds.
_COUNTERS = {
    "prompt_tokens": "Number of prefill tokens processed.",
    "generation_tokens": "Number of generation tokens processed.",
    "num_preemptions": "Cumulative number of preemptions from the engine.",
    "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
}

_LATENCY_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
_TOKEN_GAP_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
_ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
_REQUEST_LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]


def _token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_model_len:
                return out
            out.append(float(value))
        exponent += 1


def _stat(stats: Any, name: str) -> float:
    value = getattr(stats, name, 0) if stats is not None else 0
    return value or 0


class LoggingStatLogger:
    """Logs one line every `interval` seconds while there is something to say:

    Avg prompt throughput: 12.0 tokens/s, Avg generation throughput: 80.5 tokens/s,
    Running: 4 reqs, Waiting: 0 reqs, Swapped: 0 reqs, KV cache usage: 3.1%, Prefix cache hit rate: 50.0%
    """

    def __init__(self, interval: float = 5.0) -> None:
        self.interval = interval
        self._last_time: float | None = None
        self._last: dict[str, float] = {}
        self._was_idle = True

    def record(self, stats: Any, iteration: IterationStats, now: float) -> None:
        if stats is None:
            return
        if self._last_time is None:
            self._last_time = now
            self._last = {k: _stat(stats, k) for k in _COUNTERS}
            return
        elapsed = now - self._last_time
        if elapsed < self.interval:
            return
        cur = {k: _stat(stats, k) for k in _COUNTERS}
        delta = {k: cur[k] - self._last.get(k, 0) for k in cur}
        running, waiting = int(_stat(stats, "num_running")), int(_stat(stats, "num_waiting"))
        swapped = int(_stat(stats, "num_swapped"))
        idle = not any(delta.values()) and running == 0 and waiting == 0 and swapped == 0
        self._last_time, self._last = now, cur
        if idle and self._was_idle:
            return  # one line after activity stops, then quiet
        self._was_idle = idle
        queries = delta["prefix_cache_queries"]
        hit_rate = 100.0 * delta["prefix_cache_hits"] / queries if queries else 0.0
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, Swapped: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%",
            delta["prompt_tokens"] / elapsed,
            delta["generation_tokens"] / elapsed,
            running,
            waiting,
            swapped,
            100.0 * _stat(stats, "kv_cache_usage"),
            hit_rate,
        )


class PrometheusStatLogger:
    """vLLM's metrics under `pagedllm:`, registered in `registry`."""

    def __init__(self, model_name: str, registry: Any, max_model_len: int = 8192) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        labels = ["model_name"]
        self._labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"pagedllm:{name}", doc, labels, registry=registry).labels(**self._labels)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(f"pagedllm:{name}", doc, labels, buckets=buckets, registry=registry).labels(**self._labels)

        self.num_requests_running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.num_requests_swapped = gauge("num_requests_swapped", "Number of requests swapped to CPU.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.counters = {
            key: Counter(f"pagedllm:{key}", doc, labels, registry=registry).labels(**self._labels)
            for key, doc in _COUNTERS.items()
        }
        self._request_success = Counter(
            "pagedllm:request_success",
            "Count of finished requests, by finish reason (stop, length, abort, error).",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        for reason in ("stop", "length", "abort", "error"):
            self._request_success.labels(model_name=model_name, finished_reason=reason)
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", _LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _TOKEN_GAP_BUCKETS
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds",
            "Histogram of time per output token in seconds, per request: "
            "(end-to-end - time to first token) / (output tokens - 1).",
            _TOKEN_GAP_BUCKETS,
        )
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds",
            "Histogram of end-to-end request latency in seconds.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent waiting in the queue in seconds.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Histogram of number of tokens per engine_step.", _ITERATION_TOKEN_BUCKETS
        )
        self.prompt_tokens_cached = Counter(
            "pagedllm:prompt_tokens_cached",
            "Number of cached prompt tokens (served by the prefix cache).",
            labels,
            registry=registry,
        ).labels(**self._labels)
        token_buckets = _token_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed, per request.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed, per request.", token_buckets
        )
        self._last: dict[str, float] = {key: 0 for key in _COUNTERS}
        # MoE: pairs (token, chosen expert) routed to each rank's experts (expert parallelism)
        # or to all of them (one group): imbalance between groups is what users debug
        self._expert_tokens = Counter(
            "pagedllm:moe_expert_group_tokens",
            "Tokens routed to the experts of each expert group (an expert-parallel rank), summed over the MoE layers.",
            ["model_name", "expert_group"],
            registry=registry,
        )
        self._last_expert: list[int] = []
        self._replicas = ReplicaMetrics(model_name, registry)

    def record(self, stats: Any, iteration: IterationStats, now: float) -> None:
        replicas = getattr(stats, "replicas", None)
        if replicas:  # data parallelism: DPEngineStats
            self._replicas.record(replicas)
        if stats is not None:
            self.num_requests_running.set(_stat(stats, "num_running"))
            self.num_requests_waiting.set(_stat(stats, "num_waiting"))
            self.num_requests_swapped.set(_stat(stats, "num_swapped"))
            self.kv_cache_usage.set(_stat(stats, "kv_cache_usage"))
            for key, counter in self.counters.items():
                value = _stat(stats, key)
                if value > self._last[key]:
                    counter.inc(value - self._last[key])
                self._last[key] = value
            per_rank = list(getattr(stats, "expert_load_per_rank", None) or [])
            for group, value in enumerate(per_rank):
                before = self._last_expert[group] if group < len(self._last_expert) else 0
                if value > before:
                    self._expert_tokens.labels(model_name=self._labels["model_name"], expert_group=str(group)).inc(
                        value - before
                    )
            if per_rank:
                self._last_expert = per_rank
        for t in iteration.time_to_first_tokens:
            self.time_to_first_token.observe(t)
        for t in iteration.inter_token_latencies:
            self.inter_token_latency.observe(t)
        for n in iteration.step_tokens:
            self.iteration_tokens.observe(n)
        for fin in iteration.finished:
            if fin.prefill_time is not None:
                self.prefill_time.observe(fin.prefill_time)
            if fin.decode_time is not None:
                self.decode_time.observe(fin.decode_time)
            if fin.num_cached_tokens:
                self.prompt_tokens_cached.inc(fin.num_cached_tokens)
            for reason in fin.finish_reasons:
                self._request_success.labels(model_name=self._labels["model_name"], finished_reason=reason).inc()
            self.e2e_latency.observe(fin.e2e_latency)
            if fin.time_per_output_token is not None:
                self.time_per_output_token.observe(fin.time_per_output_token)
            if fin.queue_time is not None:
                self.queue_time.observe(fin.queue_time)
            self.request_prompt_tokens.observe(fin.num_prompt_tokens)
            self.request_generation_tokens.observe(fin.num_generation_tokens)


class ReplicaMetrics:
    """Per data-parallel replica, labelled `engine="<index>"` (vLLM's label): whether it is up,
    its running / waiting requests, KV-cache usage and token counters. A dead replica reads
    up 0 and its gauges 0."""

    _GAUGES = {
        "num_requests_running": "Requests in model execution batches, per data-parallel replica.",
        "num_requests_waiting": "Requests waiting to be processed, per data-parallel replica.",
        "kv_cache_usage": "KV-cache usage of each data-parallel replica (1 means 100 percent).",
    }
    _TOKENS = ("prompt_tokens", "generation_tokens")

    def __init__(self, model_name: str, registry: Any) -> None:
        from prometheus_client import Counter, Gauge

        self.model_name = model_name
        labels = ["model_name", "engine"]
        self.up = Gauge(
            "pagedllm:dp_replica_up",
            "1 while a data-parallel replica serves, 0 once it has died.",
            labels,
            registry=registry,
        )
        names = {
            "num_requests_running": "num_running",
            "num_requests_waiting": "num_waiting",
            "kv_cache_usage": "kv_cache_usage",
        }
        self.gauges = {
            names[k]: Gauge(f"pagedllm:dp_{k}", doc, labels, registry=registry) for k, doc in self._GAUGES.items()
        }
        self.counters = {
            k: Counter(f"pagedllm:dp_{k}", f"{_COUNTERS[k]} Per data-parallel replica.", labels, registry=registry)
            for k in self._TOKENS
        }
        self._last: dict[tuple[str, int], float] = {}

    def record(self, replicas: list[Any]) -> None:
        for i, st in enumerate(replicas):
            lab = {"model_name": self.model_name, "engine": str(i)}
            self.up.labels(**lab).set(0 if st is None else 1)
            for key, gauge in self.gauges.items():
                gauge.labels(**lab).set(_stat(st, key))
            if st is None:
                continue
            for key, counter in self.counters.items():
                value, last = _stat(st, key), self._last.get((key, i), 0)
                if value > last:
                    counter.labels(**lab).inc(value - last)
                self._last[(key, i)] = value
