"""Serving metrics in the Prometheus text exposition format (version 0.0.4), without a client library.

Three kinds, each a family of series keyed by label values: `Counter` (monotonic, exported with `_total`),
`Gauge`, and `Histogram` (cumulative `_bucket{le=...}`, `_sum`, `_count`). `ServingMetrics` holds the families the
server exports; engine gauges (KV pool, queues, prefix cache) are read from `Engine.stats()` at scrape time.

Observations come from the asyncio thread and the engine thread alike, so every family takes a lock.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from typing import Iterable, Mapping, Sequence

PREFIX = "dsv41_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Latency buckets in seconds (vLLM's TTFT / inter-token buckets, trimmed).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    v = float(v)
    return str(int(v)) if v.is_integer() and abs(v) < 1e15 else repr(v)


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Family:
    kind = ""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        if not _NAME_RE.match(name):
            raise ValueError(f"metric name {name!r} is not a valid Prometheus name ([a-zA-Z_:][a-zA-Z0-9_:]*)")
        self.name = name
        self.help = help_text
        self.label_names = tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: Mapping[str, str] | None) -> tuple[str, ...]:
        labels = labels or {}
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name}: labels {sorted(labels)} given, {sorted(self.label_names)} expected")
        return tuple(str(labels[n]) for n in self.label_names)

    def _header(self, kind: str) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {kind}"]


class Counter(_Family):
    """A monotonic count; `name` must end in `_total`, as the exposition format asks of counters."""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"counter {name!r}: counter names end in _total")
        super().__init__(name, help_text, labels)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, amount: float = 1.0, labels: Mapping[str, str] | None = None) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: counters only go up (got {amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, labels: Mapping[str, str] | None = None) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        # The family is declared under its base name; samples carry the `_total` suffix.
        base = self.name[: -len("_total")]
        out = [f"# HELP {base} {self.help}", f"# TYPE {base} counter"]
        with self._lock:
            items = sorted(self._values.items())
        if not items and not self.label_names:
            items = [((), 0.0)]
        out += [f"{self.name}{_labels(self.label_names, k)} {_fmt(v)}" for k, v in items]
        return out


class Gauge(_Family):
    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[tuple[str, ...], float] = {}

    def set(self, value: float, labels: Mapping[str, str] | None = None) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def value(self, labels: Mapping[str, str] | None = None) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        if not items:
            return []
        return self._header("gauge") + [f"{self.name}{_labels(self.label_names, k)} {_fmt(v)}" for k, v in items]


class Histogram(_Family):
    def __init__(self, name: str, help_text: str, buckets: Iterable[float], labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self.buckets = tuple(sorted(float(b) for b in buckets))
        if not self.buckets or any(math.isinf(b) for b in self.buckets):
            raise ValueError(f"{self.name}: give finite bucket bounds (+Inf is added on its own)")
        # per label key: (per-bucket counts [len(buckets) + 1], sum, count)
        self._series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, value: float, labels: Mapping[str, str] | None = None, count: int = 1) -> None:
        """Adds `count` observations of `value` (count > 1: e.g. one inter-token gap shared by several tokens)."""
        key = self._key(labels)
        i = bisect.bisect_left(self.buckets, value)
        with self._lock:
            counts, acc = self._series.setdefault(key, ([0] * (len(self.buckets) + 1), [0.0, 0.0]))
            counts[i] += count
            acc[0] += value * count
            acc[1] += count

    def snapshot(self, labels: Mapping[str, str] | None = None) -> tuple[list[int], float, int]:
        """(cumulative bucket counts incl. +Inf, sum, count)."""
        key = self._key(labels)
        with self._lock:
            counts, acc = self._series.get(key, ([0] * (len(self.buckets) + 1), [0.0, 0.0]))
            cum, total = [], 0
            for c in counts:
                total += c
                cum.append(total)
            return cum, acc[0], int(acc[1])

    def render(self) -> list[str]:
        out = self._header("histogram")
        with self._lock:
            keys = sorted(self._series)
        if not keys and not self.label_names:
            keys = [()]
        for key in keys:
            cum, total, count = self.snapshot(dict(zip(self.label_names, key)))
            for bound, c in zip((*self.buckets, math.inf), cum):
                out.append(f"{self.name}_bucket{_labels(self.label_names, key, f'le=\"{_fmt(bound)}\"')} {c}")
            out.append(f"{self.name}_sum{_labels(self.label_names, key)} {_fmt(total)}")
            out.append(f"{self.name}_count{_labels(self.label_names, key)} {count}")
        return out


def _stat_name(key: str) -> str:
    return PREFIX + "engine_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class ServingMetrics:
    """The server's metric families; `render(engine_stats)` gives the /metrics body."""

    def __init__(self) -> None:
        p = PREFIX
        self.http_requests = Counter(p + "http_requests_total", "HTTP requests by route, method and status.",
                                     ("route", "method", "status"))
        self.requests_started = Counter(p + "requests_total", "Generation requests accepted by the engine.",
                                        ("endpoint",))
        self.requests_finished = Counter(p + "requests_finished_total",
                                         "Generation requests finished, by finish reason.", ("finish_reason",))
        self.requests_rejected = Counter(p + "requests_rejected_total",
                                         "Requests refused before generation, by reason.", ("reason",))
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens of accepted requests.")
        self.cached_prompt_tokens = Counter(p + "prompt_cached_tokens_total",
                                            "Prompt tokens served from the prefix cache.")
        self.generation_tokens = Counter(p + "generation_tokens_total", "Tokens generated.")
        self.ttft = Histogram(p + "time_to_first_token_seconds",
                              "Time from request arrival to its first generated token.", TTFT_BUCKETS)
        self.itl = Histogram(p + "inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request.", ITL_BUCKETS)
        self.e2e = Histogram(p + "e2e_request_latency_seconds",
                             "Time from request arrival to its last token.", E2E_BUCKETS)
        self.prompt_len = Histogram(p + "request_prompt_tokens", "Prompt length of accepted requests.",
                                    TOKEN_BUCKETS)
        self.output_len = Histogram(p + "request_generation_tokens", "Tokens generated per finished request.",
                                    TOKEN_BUCKETS)
        self.step_time = Histogram(p + "engine_step_seconds", "Wall time of one engine step.", STEP_BUCKETS)
        self.step_failures = Counter(p + "engine_step_failures_total",
                                     "Engine steps that raised (their requests were failed).")
        # Read from Engine.stats() at scrape time.
        self.running = Gauge(p + "num_requests_running", "Requests in the running batch.")
        self.waiting = Gauge(p + "num_requests_waiting", "Requests in the engine's waiting queue.")
        self.kv_used = Gauge(p + "kv_cache_pages_used", "KV pool pages in use.")
        self.kv_total = Gauge(p + "kv_cache_pages_total", "KV pool pages in all.")
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "Fraction of KV pool pages in use (0..1).")
        self.prefix_hits = Gauge(p + "prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache (engine, "
                                 "cumulative).")
        self.prefix_queries = Gauge(p + "prefix_cache_query_tokens", "Prompt tokens looked up in the prefix "
                                    "cache (engine, cumulative).")
        self.prefix_hit_rate = Gauge(p + "prefix_cache_hit_rate", "prefix_cache_hit_tokens / "
                                     "prefix_cache_query_tokens (0 before any query).")
        self._families: list[_Family] = [
            self.http_requests, self.requests_started, self.requests_finished, self.requests_rejected,
            self.prompt_tokens, self.cached_prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e,
            self.prompt_len, self.output_len, self.step_time, self.step_failures, self.running, self.waiting,
            self.kv_used, self.kv_total, self.kv_usage, self.prefix_hits, self.prefix_queries,
            self.prefix_hit_rate,
        ]

    def update_from_stats(self, stats: Mapping[str, object]) -> None:
        def num(key: str) -> float | None:
            v = stats.get(key)
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

        for gauge, key in ((self.running, "running"), (self.waiting, "waiting"), (self.kv_used, "kv_pages_used"),
                           (self.kv_total, "kv_pages_total"), (self.prefix_hits, "prefix_cache_hit_tokens"),
                           (self.prefix_queries, "prefix_cache_query_tokens")):
            v = num(key)
            if v is not None:
                gauge.set(v)
        used, total = num("kv_pages_used"), num("kv_pages_total")
        if used is not None and total:
            self.kv_usage.set(used / total)
        hits, queries = num("prefix_cache_hit_tokens"), num("prefix_cache_query_tokens")
        if hits is not None and queries is not None:
            self.prefix_hit_rate.set(hits / queries if queries else 0.0)

    def render(self, engine_stats: Mapping[str, object] | None = None) -> str:
        """The exposition text. Numeric engine stats are also exported as they are, as `dsv41_engine_<key>`."""
        lines: list[str] = []
        if engine_stats:
            self.update_from_stats(engine_stats)
        for fam in self._families:
            lines += fam.render()
        for key in sorted(engine_stats or {}):
            v = engine_stats[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            name = _stat_name(key)
            lines += [f"# HELP {name} Engine.stats()[{key!r}].", f"# TYPE {name} gauge", f"{name} {_fmt(v)}"]
        return "\n".join(lines) + "\n"


def parse_text(text: str) -> dict[str, float]:
    """Samples of an exposition text as {'name{labels}': value} (for tests and the bench's scrape)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        out[series] = float(value)
    return out
