"""/metrics as Prometheus reads it: prometheus_client's own text parser, every family of its declared type, names
like vLLM's with the dsv41: prefix."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from serving_helpers import MODEL, get, scrape

from serving.metrics import ServingMetrics

# family -> type, for the families a vLLM dashboard reads (vllm:X -> dsv41:X)
EXPECTED = {
    "dsv41:time_to_first_token_seconds": "histogram",
    "dsv41:inter_token_latency_seconds": "histogram",
    "dsv41:time_per_output_token_seconds": "histogram",
    "dsv41:e2e_request_latency_seconds": "histogram",
    "dsv41:request_queue_time_seconds": "histogram",
    "dsv41:request_prefill_time_seconds": "histogram",
    "dsv41:request_decode_time_seconds": "histogram",
    "dsv41:request_prompt_tokens": "histogram",
    "dsv41:request_generation_tokens": "histogram",
    "dsv41:prompt_tokens": "counter",
    "dsv41:generation_tokens": "counter",
    "dsv41:request_success": "counter",
    "dsv41:prefix_cache_queries": "counter",
    "dsv41:prefix_cache_hits": "counter",
    "dsv41:num_preemptions": "counter",
    "dsv41:num_requests_running": "gauge",
    "dsv41:num_requests_waiting": "gauge",
    "dsv41:kv_cache_usage_perc": "gauge",
}
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def _check_exposition(text: str) -> dict:
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), f"families declared twice: {sorted(n for n in names if names.count(n) > 1)}"
    for f in families:
        assert f.type in _SUFFIXES, (f.name, f.type)
        for s in f.samples:  # every sample is named as its family's type demands
            assert s.name in {f.name + suffix for suffix in _SUFFIXES[f.type]}, (f.name, f.type, s.name)
            assert "model_name" in s.labels, s
        if f.type == "histogram":
            for key in {tuple(sorted((k, v) for k, v in s.labels.items() if k != "le")) for s in f.samples}:
                series = [s for s in f.samples if tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                          == key]
                buckets = [s.value for s in series if s.name.endswith("_bucket")]
                count = next(s.value for s in series if s.name.endswith("_count"))
                assert buckets == sorted(buckets) and buckets[-1] == count, (f.name, buckets, count)
    return {f.name: f for f in families}


def test_metrics_render_is_read_by_prometheus_parser_with_the_declared_types():
    m = ServingMetrics("tiny")
    m.ttft.observe(0.03)
    m.observe_itl(0.01, count=3)
    m.request_finished("stop")
    m.prompt_tokens.inc(5)
    text = m.render({"running": 2, "waiting": 1, "kv_pages_used": 10, "kv_pages_total": 40, "preemptions": 3,
                     "prefix_cache_hit_tokens": 30, "prefix_cache_query_tokens": 120, "flag": True,
                     "name": "x"}).decode()
    fams = _check_exposition(text)
    for name, kind in EXPECTED.items():
        assert fams[name].type == kind, (name, fams[name].type)

    def value(name, **labels):
        fam = fams[name.removesuffix("_total").removesuffix("_count")]
        return next(s.value for s in fam.samples if s.name == name and labels.items() <= s.labels.items())

    assert value("dsv41:kv_cache_usage_perc", rank="0") == 0.25
    assert value("dsv41:num_preemptions_total") == 3 and value("dsv41:prefix_cache_hits_total") == 30
    assert value("dsv41:num_requests_running") == 2
    assert value("dsv41:inter_token_latency_seconds_count") == 3
    assert value("dsv41:request_success_total", finished_reason="stop") == 1
    assert value("dsv41:prompt_tokens_total", model_name="tiny") == 5
    assert not any("flag" in n or n.endswith(":name") for n in fams)
    assert "_created" not in text


def test_kv_usage_per_rank():
    m = ServingMetrics()
    fams = _check_exposition(m.render({"kv_pages_used_per_rank": [1, 3], "kv_pages_total_per_rank": [4, 4]})
                             .decode())
    usage = {s.labels["rank"]: s.value for s in fams["dsv41:kv_cache_usage_perc"].samples}
    assert usage == {"0": 0.25, "1": 0.75}


def test_served_metrics_parse_after_traffic(fake_server):
    assert get(fake_server, "/v1/models")[0] == 200
    from serving_helpers import post

    assert post(fake_server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})[0] == 200
    assert post(fake_server, "/v1/completions", {"prompt": "hi", "top_p": 7})[0] == 400
    code, text = get(fake_server, "/metrics")
    assert code == 200
    fams = _check_exposition(text)
    for name, kind in EXPECTED.items():
        assert fams[name].type == kind, (name, fams[name].type)
    assert scrape(fake_server)["dsv41:http_requests"].type == "counter"


def test_data_parallel_ranks_report_load_and_hits():
    m = ServingMetrics()
    fams = _check_exposition(m.render({"running_per_rank": [2, 0], "prefix_cache_hit_tokens_per_rank": [128, 0],
                                       "prefix_cache_query_tokens_per_rank": [300, 40]}).decode())
    running = {s.labels["rank"]: s.value for s in fams["dsv41:rank_requests_running"].samples}
    hits = {s.labels["rank"]: s.value for s in fams["dsv41:rank_prefix_cache_hits"].samples}
    assert running == {"0": 2, "1": 0} and hits == {"0": 128, "1": 0}


def test_speculative_decoding_families_only_when_it_runs():
    m = ServingMetrics()
    assert not any("spec_decode" in n for n in _check_exposition(m.render({"running": 1}).decode()))
    fams = _check_exposition(m.render({"spec_drafts": 10, "spec_draft_tokens": 50, "spec_accepted_tokens": 25,
                                       "spec_accepted_per_pos": [9, 7, 5, 3, 1],
                                       "spec_verified_per_len": [0, 0, 0, 0, 0, 10]}).decode())
    total = {n: next(s.value for s in fams[f"dsv41:spec_decode_num_{n}"].samples)
             for n in ("drafts", "draft_tokens", "accepted_tokens")}
    assert total == {"drafts": 10, "draft_tokens": 50, "accepted_tokens": 25}  # acceptance length 1 + 25/10
    per_pos = {s.labels["position"]: s.value for s in fams["dsv41:spec_decode_num_accepted_tokens_per_pos"].samples}
    assert per_pos == {"0": 9, "1": 7, "2": 5, "3": 3, "4": 1}
    per_len = {s.labels["length"]: s.value for s in fams["dsv41:spec_decode_num_drafts_per_verify_len"].samples}
    assert per_len == {"0": 0, "1": 0, "2": 0, "3": 0, "4": 0, "5": 10}


def test_warmup_families_only_after_a_warmup():
    m = ServingMetrics()
    assert not any("warmup" in n for n in _check_exposition(m.render({"running": 1}).decode()))
    fams = _check_exposition(m.render({"warmup_programs_ready": 3, "warmup_programs": 11}).decode())
    got = {n: fams[f"dsv41:{n}"].samples[0].value for n in ("warmup_programs_ready", "warmup_programs")}
    assert got == {"warmup_programs_ready": 3, "warmup_programs": 11}
