"""Serving metrics on prometheus-client, named like vLLM's with a `dsv41:` prefix so its dashboards port over
(vllm:time_to_first_token_seconds -> dsv41:time_to_first_token_seconds, ...). Every family carries vLLM's
`model_name` label.

Request-level families are observed as requests go (the asyncio thread and the engine thread alike; the client
library locks). Engine-level ones (running / waiting, KV pool, prefix cache, preemptions) are read from the
engine's cumulative `Engine.stats()` at scrape time by `_EngineStatsCollector`, so a counter of the engine is
exported as a counter, never as a gauge.
"""

from __future__ import annotations

import logging
import threading
from typing import Iterable, Mapping

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# `_created` samples double every counter and histogram for no dashboard's benefit; vLLM turns them off too.
prometheus_client.disable_created_metrics()

PREFIX = "dsv41:"
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

# Bucket bounds: vLLM's (v1) for the latency families, powers of two for token counts.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
FINE_ITL_BUCKETS = (0.001, 0.0025, 0.005, *ITL_BUCKETS)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
TOKEN_BUCKETS = tuple(2 ** i for i in range(21))

# Engine.stats() key -> (family, help); cumulative counts of the engine are counters, the rest gauges.
_STAT_COUNTERS = {
    "prefix_cache_query_tokens": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hit_tokens": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "preemptions": ("num_preemptions", "Requests preempted (their KV freed, to be recomputed)."),
    "prefill_tokens": ("engine_prefill_tokens", "Prompt tokens run by prefill steps."),
    "prefill_calls": ("engine_prefill_calls", "Prefill program calls (short prompts may share one)."),
    "decode_steps": ("engine_decode_steps", "Decode steps run."),
}
# speculative decoding (vLLM's spec_decode families), exported when the engine speculates; acceptance length =
# 1 + accepted tokens / drafts
_SPEC_COUNTERS = {
    "spec_drafts": ("spec_decode_num_drafts", "Draft blocks verified (one a request a step)."),
    "spec_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens verified."),
    "spec_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
}
_STAT_GAUGES = {
    "running": ("num_requests_running", "Requests in the running batch."),
    "waiting": ("num_requests_waiting", "Requests in the engine's waiting queue."),
}


class _EngineStatsCollector(Collector):
    """Families from the last engine stats snapshot (a dict of numbers), read at each scrape."""

    def __init__(self, model_name: str) -> None:
        self._model = model_name
        self._lock = threading.Lock()
        self._stats: dict[str, object] = {}

    def update(self, stats: Mapping[str, object]) -> None:
        with self._lock:
            self._stats = dict(stats)

    def describe(self) -> Iterable[Metric]:
        return []  # families depend on the snapshot; the registry must not pre-check them

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            stats = dict(self._stats)

        def num(key: str) -> float | None:
            v = stats.get(key)
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

        labels = ["model_name"]
        for key, (name, help_text) in _STAT_GAUGES.items():
            g = GaugeMetricFamily(PREFIX + name, help_text, labels=labels)
            g.add_metric([self._model], num(key) or 0.0)
            yield g
        for key, (name, help_text) in _STAT_COUNTERS.items():
            c = CounterMetricFamily(PREFIX + name, help_text, labels=labels)
            c.add_metric([self._model], num(key) or 0.0)
            yield c
        if num("warmup_programs") is not None:  # an engine that warmed up
            for key, help_text in (("warmup_programs_ready", "Compiled programs in use (a staged warm-up compiles "
                                    "the others while serving, steps padding to these)."),
                                   ("warmup_programs", "Programs warm-up compiles and loads.")):
                g = GaugeMetricFamily(PREFIX + key, help_text, labels=labels)
                g.add_metric([self._model], num(key) or 0.0)
                yield g
        per_pos = stats.get("spec_accepted_per_pos")
        if isinstance(per_pos, (list, tuple)):
            for key, (name, help_text) in _SPEC_COUNTERS.items():
                c = CounterMetricFamily(PREFIX + name, help_text, labels=labels)
                c.add_metric([self._model], num(key) or 0.0)
                yield c
            c = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted at each block position.", labels=["model_name", "position"])
            for i, v in enumerate(per_pos):
                c.add_metric([self._model, str(i)], float(v))
            yield c
            c = CounterMetricFamily(PREFIX + "spec_decode_num_drafts_per_verify_len",
                                    "Draft blocks by the drafts verified (confidence_threshold cuts them).",
                                    labels=["model_name", "length"])
            for n, v in enumerate(stats.get("spec_verified_per_len") or ()):
                c.add_metric([self._model, str(n)], float(v))
            yield c
        # KV usage per rank: an engine on several devices reports lists; one device is rank 0
        used, total = stats.get("kv_pages_used_per_rank"), stats.get("kv_pages_total_per_rank")
        if not (isinstance(used, (list, tuple)) and isinstance(total, (list, tuple)) and len(used) == len(total)):
            used, total = [num("kv_pages_used") or 0.0], [num("kv_pages_total") or 0.0]
        usage = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "Fraction of KV cache pages in use (0..1).",
                                  labels=["model_name", "rank"])
        pages = GaugeMetricFamily(PREFIX + "kv_cache_pages_used", "KV cache pages in use.",
                                  labels=["model_name", "rank"])
        pages_total = GaugeMetricFamily(PREFIX + "kv_cache_pages_total", "KV cache pages in all.",
                                        labels=["model_name", "rank"])
        for rank, (u, t) in enumerate(zip(used, total)):
            usage.add_metric([self._model, str(rank)], float(u) / float(t) if t else 0.0)
            pages.add_metric([self._model, str(rank)], float(u))
            pages_total.add_metric([self._model, str(rank)], float(t))
        yield from (usage, pages, pages_total)
        # data-parallel ranks: load and prefix-cache hits of each (its conversations stay there: session affinity)
        running = GaugeMetricFamily(PREFIX + "rank_requests_running", "Requests running on a data-parallel rank.",
                                    labels=["model_name", "rank"])
        hits = CounterMetricFamily(PREFIX + "rank_prefix_cache_hits",
                                   "Prompt tokens found in a rank's prefix cache.", labels=["model_name", "rank"])
        queries = CounterMetricFamily(PREFIX + "rank_prefix_cache_queries",
                                      "Prompt tokens looked up in a rank's prefix cache.",
                                      labels=["model_name", "rank"])
        for fam, key in ((running, "running_per_rank"), (hits, "prefix_cache_hit_tokens_per_rank"),
                         (queries, "prefix_cache_query_tokens_per_rank")):
            values = stats.get(key)
            if isinstance(values, (list, tuple)):
                for rank, v in enumerate(values):
                    fam.add_metric([self._model, str(rank)], float(v))
            yield fam


class ServingMetrics:
    """The server's metric families on a registry of their own (one per server, so tests can run several)."""

    def __init__(self, model_name: str = "dsv41") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, p, m = self.registry, PREFIX, {"model_name": model_name}

        def counter(name: str, help_text: str, labels: tuple[str, ...] = ()) -> Counter:
            fam = Counter(p + name, help_text, ["model_name", *labels], registry=r)
            return fam if labels else fam.labels(**m)

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(p + name, help_text, ["model_name"], buckets=buckets, registry=r).labels(**m)

        self._finished = counter("request_success", "Finished requests, by finish reason.", ("finished_reason",))
        self._rejected = counter("requests_rejected", "Requests refused before generation, by reason.", ("reason",))
        self._started = counter("requests_started", "Generation requests accepted by the engine, by endpoint.",
                                ("endpoint",))
        self._http = counter("http_requests", "HTTP requests by route, method and status.",
                             ("route", "method", "status"))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of accepted requests.")
        self.cached_prompt_tokens = counter("prompt_tokens_cached", "Prompt tokens served from the prefix cache.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.step_failures = counter("engine_step_failures", "Engine steps that raised (their requests failed).")
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first generated token.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             FINE_ITL_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per output token after the first, "
                              "per finished request.", FINE_ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time a request waited in the engine's queue.",
                                    REQUEST_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Time from scheduling to the first token.",
                                      REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Time from the first token to the last.",
                                     REQUEST_BUCKETS)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt tokens per accepted request.", TOKEN_BUCKETS)
        self.output_len = histogram("request_generation_tokens", "Generated tokens per finished request.",
                                    TOKEN_BUCKETS)
        self.step_time = histogram("engine_step_seconds", "Wall time of one engine step.", STEP_BUCKETS)
        self._engine = _EngineStatsCollector(model_name)
        r.register(self._engine)

    def request_finished(self, reason: str | None) -> None:
        self._finished.labels(model_name=self.model_name, finished_reason=str(reason)).inc()

    def request_rejected(self, reason: str) -> None:
        self._rejected.labels(model_name=self.model_name, reason=reason).inc()

    def request_started(self, endpoint: str) -> None:
        self._started.labels(model_name=self.model_name, endpoint=endpoint).inc()

    def http_request(self, route: str, method: str, status: int) -> None:
        self._http.labels(model_name=self.model_name, route=route, method=method, status=str(status)).inc()

    def observe_itl(self, gap_s: float, count: int = 1) -> None:
        """`count` inter-token gaps of `gap_s` (tokens that arrived together share the gap)."""
        for _ in range(count):
            self.itl.observe(gap_s)

    def update_from_stats(self, stats: Mapping[str, object]) -> None:
        self._engine.update(stats)

    def render(self, engine_stats: Mapping[str, object] | None = None) -> bytes:
        """The exposition text (prometheus-client's text format)."""
        if engine_stats is not None:
            self.update_from_stats(engine_stats)
        return prometheus_client.generate_latest(self.registry)

    def sample(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        """One sample's value by its exposed name (tests, the bench); `model_name` is filled in."""
        return self.registry.get_sample_value(name, {"model_name": self.model_name, **(labels or {})})
