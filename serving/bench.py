"""Agentic multi-turn load generator for a running OpenAI-compatible server (`dsv41 bench serve`).

Each session is an agent loop: a system prompt shared by all sessions (cross-session prefix reuse), then turns
that each append the previous answer plus a new user message (the context grows, so every turn after the first
should hit the prefix cache), short outputs, and a think-time gap between turns (exponential, seeded). A
semaphore caps the requests in flight. The run is repeated for each `max_concurrency` level; by default a level
runs as many sessions as its concurrency, so the load grows with it.

Per level it reports TTFT, inter-token latency (per token: the gap between two streamed chunks shared by the
tokens generated in it, which each chunk's usage tells under vLLM's `stream_options.continuous_usage_stats`; a
token that decodes to no text, frequent with random weights, adds to the next chunk), TPOT ((latency - TTFT) /
(tokens - 1)), end-to-end latency (percentiles of each), total and output tokens/s, per-user tokens/s, and the
prefix-cache hit rate from `usage.prompt_tokens_details.cached_tokens`. It writes `bench_serve.json` and, when
matplotlib is importable, `throughput_vs_interactivity.png` and `ttft_vs_load.png` into the result directory.

With `long_prompt_rate` > 0, single-turn requests of `long_prompt_len` fresh words (no prefix-cache hit) also
arrive during each level, open loop (Poisson at that rate, the first at the level's start, outside the
concurrency cap): the sessions' TPOT and inter-token latency then show how far a long prompt's prefill stalls
the running streams. The long prompts' own results are reported apart (`long_prompts`).

TTFT is taken at the first streamed chunk: the dsv41 server sends nothing before the first token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import pathlib
import random
import time
from typing import Any, Sequence

import aiohttp
import numpy as np

log = logging.getLogger(__name__)

_WORDS = ("the quick brown fox jumps over lazy dog agent tool call result file line error test build run value "
          "function return list map key index cache page token model layer batch step queue server client "
          "request response stream session user system prompt context window memory compute kernel shape "
          "array matrix vector sum mean max min sort search read write open close parse format check fix "
          "update create delete move copy path name type class method module package import export config "
          "option flag default limit size count time rate load latency throughput").split()


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first model of GET /v1/models
    max_concurrency: tuple[int, ...] = (4,)
    num_sessions: int | None = None  # None: as many as the level's concurrency
    num_turns: int = 4
    think_time_s: float = 1.0  # mean of the exponential gap between a session's turns (0: none)
    shared_prefix_len: int = 256  # words of the system prompt that all sessions share
    first_input_len: int = 128  # words of a session's first user message
    turn_input_len: int = 32  # words of each later user message
    output_len: int = 32  # max_tokens of each turn
    ignore_eos: bool = True  # ask the server to ignore EOS so every turn generates output_len tokens
    thinking: bool = False
    temperature: float = 0.0
    seed: int = 0
    num_warmups: int = 0  # single-turn requests sent (and not counted) before the first level
    long_prompt_len: int = 3000  # words of each long prompt (3000: 7.9K tokens with the built-in tokenizer)
    long_prompt_rate: float = 0.0  # long prompts a second during each level (0: none)
    request_timeout_s: float = 600.0
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    result_dir: str | None = None  # None: no files written

    def __post_init__(self) -> None:
        problems = []
        if not self.max_concurrency or any(c < 1 for c in self.max_concurrency):
            problems.append(f"max_concurrency {self.max_concurrency}: give one or more levels >= 1")
        if self.num_sessions is not None and self.num_sessions < 1:
            problems.append(f"num_sessions {self.num_sessions}: give >= 1")
        for name in ("num_turns", "output_len"):
            if getattr(self, name) < 1:
                problems.append(f"{name} {getattr(self, name)}: give >= 1")
        for name in ("think_time_s", "shared_prefix_len", "first_input_len", "turn_input_len", "num_warmups",
                     "long_prompt_len", "long_prompt_rate"):
            if getattr(self, name) < 0:
                problems.append(f"{name} {getattr(self, name)}: give >= 0")
        if any(not 0 < p <= 100 for p in self.percentiles):
            problems.append(f"percentiles {self.percentiles}: give values in (0, 100]")
        if problems:
            raise ValueError("bench config: " + "; ".join(problems))


@dataclasses.dataclass
class TurnResult:
    session: int
    turn: int
    ok: bool
    error: str = ""
    start: float = 0.0
    ttft_s: float = math.nan
    latency_s: float = math.nan
    itl_s: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    answer: str = ""

    @property
    def tpot_s(self) -> float:
        if not self.ok or self.completion_tokens < 2:
            return math.nan
        return (self.latency_s - self.ttft_s) / (self.completion_tokens - 1)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


class _Client:
    def __init__(self, cfg: BenchConfig, http: aiohttp.ClientSession, model: str) -> None:
        self.cfg = cfg
        self.http = http
        self.model = model

    async def chat(self, messages: list[dict[str, Any]], session_id: str, result: TurnResult) -> None:
        cfg = self.cfg
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": cfg.output_len, "temperature": cfg.temperature,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "user": session_id, "seed": cfg.seed,
        }
        if cfg.ignore_eos:
            body["ignore_eos"] = True
        if cfg.thinking:
            body["chat_template_kwargs"] = {"thinking": True}
        t0 = time.perf_counter()
        result.start = t0
        last = None
        last_tokens = 0
        parts: list[str] = []
        async with self.http.post(cfg.base_url.rstrip("/") + "/v1/chat/completions", json=body,
                                  headers={"X-Session-Id": session_id}) as resp:
            if resp.status != 200:
                text = (await resp.text())[:500]
                raise RuntimeError(f"HTTP {resp.status}: {text}")
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error'].get('message')}")
                now = time.perf_counter()
                if chunk.get("usage"):
                    u = chunk["usage"]
                    result.prompt_tokens = int(u.get("prompt_tokens", 0))
                    result.completion_tokens = int(u.get("completion_tokens", 0))
                    result.cached_tokens = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    # a server without continuous usage: one token per chunk that carries text
                    has_text = bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))
                    tokens = int((chunk.get("usage") or {}).get("completion_tokens") or last_tokens + has_text)
                    if last is None:
                        result.ttft_s = now - t0
                    elif tokens > last_tokens:
                        result.itl_s.extend([(now - last) / (tokens - last_tokens)] * (tokens - last_tokens))
                    if delta.get("content"):
                        parts.append(delta["content"])
                    if last is None or tokens > last_tokens:
                        last, last_tokens = now, tokens
        result.latency_s = time.perf_counter() - t0
        result.answer = "".join(parts)
        result.ok = last is not None
        if not result.ok:
            result.error = "the stream ended without a chunk"


async def _session(client: _Client, cfg: BenchConfig, sem: asyncio.Semaphore, system: str, level: int, index: int,
                   results: list[TurnResult]) -> None:
    rng = random.Random(f"{cfg.seed}-{level}-{index}")
    session_id = f"bench-c{level}-s{index}-{cfg.seed}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": f"Task {index}: " + _words(rng, cfg.first_input_len)}]
    for turn in range(cfg.num_turns):
        if turn > 0 and cfg.think_time_s > 0:
            await asyncio.sleep(rng.expovariate(1.0 / cfg.think_time_s))
        r = TurnResult(session=index, turn=turn, ok=False)
        async with sem:
            try:
                await client.chat(messages, session_id, r)
            except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as e:
                r.ok = False
                r.error = f"{type(e).__name__}: {e}"[:300]
                log.warning("session %d turn %d failed: %s", index, turn, r.error)
        results.append(r)
        if not r.ok:
            return  # the conversation cannot go on without its answer
        messages.append({"role": "assistant", "content": r.answer})
        messages.append({"role": "user", "content": _words(rng, cfg.turn_input_len)})


async def _long_prompts(client: _Client, cfg: BenchConfig, level: int, results: list[TurnResult],
                        stop: asyncio.Event) -> None:
    """Single-turn requests of cfg.long_prompt_len fresh words, Poisson at cfg.long_prompt_rate from the level's
    start until `stop`; waits for those sent."""
    rng = random.Random(f"{cfg.seed}-long-{level}")

    async def one(i: int) -> None:
        # the numbered head makes the first KV page differ: no prefix-cache hit
        messages = [{"role": "user", "content": f"Document {level}-{i}: " + _words(rng, cfg.long_prompt_len)}]
        r = TurnResult(session=-1, turn=i, ok=False)
        try:
            await client.chat(messages, f"bench-long-c{level}-{i}-{cfg.seed}", r)
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as e:
            r.error = f"{type(e).__name__}: {e}"[:300]
            log.warning("long prompt %d failed: %s", i, r.error)
        results.append(r)

    sent: list[asyncio.Task] = []
    while not stop.is_set():
        sent.append(asyncio.create_task(one(len(sent))))
        try:
            await asyncio.wait_for(stop.wait(), rng.expovariate(cfg.long_prompt_rate))
        except asyncio.TimeoutError:
            pass
    await asyncio.gather(*sent)


def _pcts(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    v = np.asarray([x for x in values if not math.isnan(x)], dtype=np.float64)
    out = {"mean": float(v.mean()) if v.size else math.nan}
    for p in percentiles:
        out[f"p{p:g}"] = float(np.percentile(v, p)) if v.size else math.nan
    return out


def summarize(results: list[TurnResult], duration_s: float, concurrency: int, sessions: int,
              percentiles: Sequence[float]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    out_tok = sum(r.completion_tokens for r in ok)
    later = [r for r in ok if r.turn > 0]
    tpots = [r.tpot_s for r in ok]
    per_user = [1.0 / t for t in tpots if not math.isnan(t) and t > 0]
    return {
        "max_concurrency": concurrency,
        "sessions": sessions,
        "requests_ok": len(ok),
        "requests_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration_s,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": out_tok,
        "output_tokens_per_s": out_tok / duration_s if duration_s > 0 else math.nan,
        "total_tokens_per_s": (prompt + out_tok) / duration_s if duration_s > 0 else math.nan,
        "prefix_hit_rate": cached / prompt if prompt else math.nan,
        "prefix_hit_rate_later_turns": (sum(r.cached_tokens for r in later) / sum(r.prompt_tokens for r in later)
                                        if later and sum(r.prompt_tokens for r in later) else math.nan),
        "ttft_ms": {k: v * 1e3 for k, v in _pcts([r.ttft_s for r in ok], percentiles).items()},
        "itl_ms": {k: v * 1e3 for k, v in _pcts([x for r in ok for x in r.itl_s], percentiles).items()},
        "tpot_ms": {k: v * 1e3 for k, v in _pcts(tpots, percentiles).items()},
        "e2e_ms": {k: v * 1e3 for k, v in _pcts([r.latency_s for r in ok], percentiles).items()},
        "per_user_tokens_per_s": _pcts(per_user, percentiles),
    }


async def _resolve_model(http: aiohttp.ClientSession, cfg: BenchConfig) -> str:
    if cfg.model:
        return cfg.model
    url = cfg.base_url.rstrip("/") + "/v1/models"
    async with http.get(url) as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET {url}: HTTP {resp.status}; is the server up? pass --model to skip this")
        data = (await resp.json()).get("data") or []
    if not data:
        raise RuntimeError(f"GET {url} lists no model; pass --model")
    return data[0]["id"]


def _system(cfg: BenchConfig) -> str:
    return "You are a coding agent. Project notes: " + _words(random.Random(cfg.seed), cfg.shared_prefix_len)


_SPEC_FAMILIES = ("dsv41:spec_decode_num_drafts", "dsv41:spec_decode_num_accepted_tokens",
                  "dsv41:spec_decode_num_accepted_tokens_per_pos", "dsv41:spec_decode_num_draft_tokens")


async def _spec_counters(http: aiohttp.ClientSession, cfg: BenchConfig) -> dict[str, Any] | None:
    """The server's speculative-decoding counters from /metrics: {drafts, accepted, verified, per_pos: [...]}; None
    when it does not speculate (or has no /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with http.get(cfg.base_url.rstrip("/") + "/metrics") as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except aiohttp.ClientError:
        return None
    fams = {f.name: f for f in text_string_to_metric_families(text) if f.name in _SPEC_FAMILIES}
    if len(fams) < len(_SPEC_FAMILIES):
        return None
    total = lambda name: sum(s.value for s in fams[name].samples if s.name.endswith("_total"))  # noqa: E731
    per_pos = sorted((int(s.labels["position"]), s.value) for s in fams[_SPEC_FAMILIES[2]].samples
                     if s.name.endswith("_total"))
    return {"drafts": total(_SPEC_FAMILIES[0]), "accepted": total(_SPEC_FAMILIES[1]),
            "verified": total(_SPEC_FAMILIES[3]), "per_pos": [v for _, v in per_pos]}


def spec_summary(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """A level's speculative decoding from the counters before and after it: acceptance length (tokens a request
    takes a step: 1 + accepted drafts / drafts), each block position's acceptance rate and the mean verification
    length (drafts verified a block: k, or fewer with confidence_threshold)."""
    if before is None or after is None or after["drafts"] <= before["drafts"]:
        return None
    n = after["drafts"] - before["drafts"]
    per_pos = [(a - b) / n for a, b in zip(after["per_pos"], before["per_pos"])]
    return {"acceptance_length": 1 + (after["accepted"] - before["accepted"]) / n, "acceptance_per_pos": per_pos,
            "verify_length": (after["verified"] - before["verified"]) / n}


async def run_level(cfg: BenchConfig, http: aiohttp.ClientSession, model: str, concurrency: int) -> dict[str, Any]:
    sessions = cfg.num_sessions or concurrency
    system = _system(cfg)
    client = _Client(cfg, http, model)
    sem = asyncio.Semaphore(concurrency)
    results: list[TurnResult] = []
    spec_before = await _spec_counters(http, cfg)
    long_results: list[TurnResult] = []
    stop = asyncio.Event()
    long = (asyncio.create_task(_long_prompts(client, cfg, concurrency, long_results, stop))
            if cfg.long_prompt_rate > 0 else None)
    t0 = time.perf_counter()
    await asyncio.gather(*(_session(client, cfg, sem, system, concurrency, i, results) for i in range(sessions)))
    summary = summarize(results, time.perf_counter() - t0, concurrency, sessions, cfg.percentiles)
    if long is not None:
        stop.set()
        await long
        ok = [r for r in long_results if r.ok]
        summary["long_prompts"] = {
            "sent": len(long_results), "ok": len(ok),
            "prompt_tokens_mean": float(np.mean([r.prompt_tokens for r in ok])) if ok else math.nan,
            "ttft_ms": {k: v * 1e3 for k, v in _pcts([r.ttft_s for r in ok], cfg.percentiles).items()}}
    spec = spec_summary(spec_before, await _spec_counters(http, cfg) if spec_before is not None else None)
    if spec is not None:
        summary["speculative"] = spec
    return summary


async def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Runs every concurrency level; returns {"config": ..., "levels": [summary, ...]} and writes the files."""
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as http:
        model = await _resolve_model(http, cfg)
        if cfg.num_warmups:
            log.info("warming up with %d request(s) (not counted)", cfg.num_warmups)
            warm = dataclasses.replace(cfg, num_turns=1)
            await asyncio.gather(*(_session(_Client(warm, http, model), warm, asyncio.Semaphore(1), _system(cfg),
                                            0, i, []) for i in range(cfg.num_warmups)))
        levels = []
        for c in cfg.max_concurrency:
            log.info("level max_concurrency=%d: %d session(s) x %d turn(s), output_len %d", c,
                     cfg.num_sessions or c, cfg.num_turns, cfg.output_len)
            summary = await run_level(cfg, http, model, c)
            log_summary(summary)
            levels.append(summary)
    report = {"config": dataclasses.asdict(cfg), "model": model, "levels": levels}
    if cfg.result_dir:
        out = pathlib.Path(cfg.result_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_serve.json").write_text(json.dumps(report, indent=2, default=str))
        log.info("wrote %s", out / "bench_serve.json")
        report["plots"] = [str(p) for p in write_plots(levels, out)]
    return report


def log_summary(s: dict[str, Any]) -> None:
    def row(name: str, d: dict[str, float], unit: str) -> str:
        return f"  {name:<22}" + "  ".join(f"{k}={v:9.2f}" for k, v in d.items()) + f"  ({unit})"

    lines = [
        f"max_concurrency={s['max_concurrency']} sessions={s['sessions']}: {s['requests_ok']} ok, "
        f"{s['requests_failed']} failed in {s['duration_s']:.2f} s",
        f"  output tokens/s       {s['output_tokens_per_s']:.1f}   total tokens/s {s['total_tokens_per_s']:.1f}",
        f"  prefix hit rate       {s['prefix_hit_rate']:.3f} (turns after the first: "
        f"{s['prefix_hit_rate_later_turns']:.3f}); {s['cached_tokens']}/{s['prompt_tokens']} prompt tokens cached",
        row("TTFT", s["ttft_ms"], "ms"), row("inter-token latency", s["itl_ms"], "ms"),
        row("TPOT", s["tpot_ms"], "ms"), row("end-to-end", s["e2e_ms"], "ms"),
        row("per-user tokens/s", s["per_user_tokens_per_s"], "tok/s"),
    ]
    if "long_prompts" in s:
        lp = s["long_prompts"]
        lines.append(f"  long prompts          {lp['ok']}/{lp['sent']} ok, {lp['prompt_tokens_mean']:.0f} tokens each "
                     "(not in the rows above)")
        lines.append(row("long prompt TTFT", lp["ttft_ms"], "ms"))
    if "speculative" in s:
        sp = s["speculative"]
        lines.append(f"  acceptance length     {sp['acceptance_length']:.2f}   per position "
                     + " ".join(f"{r:.2f}" for r in sp["acceptance_per_pos"])
                     + f"   drafts verified {sp['verify_length']:.2f}")
    if s["errors"]:
        lines.append(f"  errors: {s['errors']}")
    log.info("\n".join(lines))


def write_plots(levels: list[dict[str, Any]] | dict[str, list[dict[str, Any]]], out: pathlib.Path,
                title: str = "") -> list[pathlib.Path]:
    """throughput_vs_interactivity.png and ttft_vs_load.png; none (with a log line) without matplotlib.
    levels: one run's level summaries, or {label: levels} to draw several runs (server variants) together."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not importable; skipping the plots (pip install matplotlib to get them)")
        return []
    runs = levels if isinstance(levels, dict) else {"": levels}
    suffix = f" ({title})" if title else ""
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for label, lv in runs.items():
        x = [s["per_user_tokens_per_s"]["p50"] for s in lv]
        y = [s["output_tokens_per_s"] for s in lv]
        ax.plot(x, y, "o-", label=label or None)
        for s, xi, yi in zip(lv, x, y):
            ax.annotate(f"c={s['max_concurrency']}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("interactivity: median per-user tokens/s (1 / TPOT)")
    ax.set_ylabel("output tokens/s (all users)")
    ax.set_title("Throughput vs interactivity" + suffix)
    ax.grid(True, alpha=0.3)
    if len(runs) > 1:
        ax.legend()
    paths.append(out / "throughput_vs_interactivity.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.5))
    conc = sorted({s["max_concurrency"] for lv in runs.values() for s in lv})
    for label, lv in runs.items():
        for key in [k for k in lv[0]["ttft_ms"] if k != "mean"]:
            ax.plot([s["max_concurrency"] for s in lv], [s["ttft_ms"][key] for s in lv], "o-",
                    label=f"{label} TTFT {key}".strip())
    if max(conc) >= 4 * min(conc):
        ax.set_xscale("log", base=2)
    ax.set_xlabel("max concurrency (sessions in flight)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT vs load" + suffix)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(out / "ttft_vs_load.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    for p in paths:
        log.info("wrote %s", p)
    return paths
