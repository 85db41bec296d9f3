"""Smoke runs of the agentic load generator (2 sessions x 2 turns) against a live server."""

from __future__ import annotations

import asyncio
import json
import logging
import sys

import pytest

from serving.bench import BenchConfig, run_bench, write_plots


def _bench(srv, tmp_path, **kw):
    # prompts of 65..128 tokens: one prefill chunk and two KV pages on the tiny engine (few compiled shapes)
    cfg = BenchConfig(base_url=srv.base_url, max_concurrency=(1, 2), num_sessions=2, num_turns=2, think_time_s=0.01,
                      shared_prefix_len=25, first_input_len=3, turn_input_len=3, output_len=3,
                      result_dir=str(tmp_path), **kw)
    return asyncio.run(run_bench(cfg))


def _check(report, tmp_path):
    assert [lv["max_concurrency"] for lv in report["levels"]] == [1, 2]
    for lv in report["levels"]:
        assert lv["requests_ok"] == 4 and lv["requests_failed"] == 0, lv["errors"]
        assert lv["output_tokens"] == 4 * 3  # ignore_eos: every turn makes output_len tokens
        assert lv["ttft_ms"]["p50"] > 0 and lv["e2e_ms"]["p99"] >= lv["ttft_ms"]["p99"]
        # per token (continuous usage): finite even when tokens decode to no text (random weights)
        assert lv["output_tokens_per_s"] > 0 and lv["itl_ms"]["p50"] > 0
        assert lv["prefix_hit_rate_later_turns"] > 0  # turn 2 extends turn 1's prompt
    saved = json.loads((tmp_path / "bench_serve.json").read_text())
    assert saved["levels"][0]["requests_ok"] == 4
    assert {p.rsplit("/", 1)[-1] for p in report["plots"]} == {"throughput_vs_interactivity.png", "ttft_vs_load.png"}
    assert all((tmp_path / name).stat().st_size > 1000 for name in ("throughput_vs_interactivity.png",
                                                                    "ttft_vs_load.png"))


def test_bench_smoke(fake_server, tmp_path):
    _check(_bench(fake_server, tmp_path), tmp_path)


@pytest.mark.slow
@pytest.mark.xdist_group("tiny_server")  # with the API tests' tiny server, on one worker (test_api.py)
def test_bench_smoke_tiny(tiny_server, tmp_path):
    _check(_bench(tiny_server, tmp_path), tmp_path)


def test_bench_long_prompts_arrive_apart(fake_server, tmp_path):
    """Long prompts arrive during each level (the first at its start) and are reported apart from the sessions."""
    report = _bench(fake_server, tmp_path, long_prompt_rate=20.0, long_prompt_len=40)
    _check(report, tmp_path)
    for lv in report["levels"]:
        lp = lv["long_prompts"]
        assert lp["sent"] >= 1 and lp["ok"] == lp["sent"], lp
        assert lp["prompt_tokens_mean"] > 40 and lp["ttft_ms"]["p50"] > 0


def test_plots_skipped_without_matplotlib(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with caplog.at_level(logging.INFO, logger="serving.bench"):
        assert write_plots([], tmp_path) == []
    assert "skipping the plots" in caplog.text


def test_bench_config_validation():
    with pytest.raises(ValueError, match="max_concurrency"):
        BenchConfig(max_concurrency=(0,))
    with pytest.raises(ValueError, match="num_turns"):
        BenchConfig(num_turns=0)


def test_speculative_summary_from_counter_deltas():
    from serving.bench import spec_summary

    before = {"drafts": 10, "accepted": 20, "verified": 50, "per_pos": [8, 6, 4, 2, 0]}
    after = {"drafts": 30, "accepted": 70, "verified": 110, "per_pos": [26, 20, 14, 8, 2]}
    s = spec_summary(before, after)
    assert s["acceptance_length"] == 1 + 50 / 20 and s["verify_length"] == 60 / 20
    assert s["acceptance_per_pos"] == [0.9, 0.7, 0.5, 0.3, 0.1]
    assert spec_summary(None, after) is None and spec_summary(after, after) is None
