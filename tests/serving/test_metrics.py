from __future__ import annotations

import re

import pytest

from serving.metrics import Counter, Gauge, Histogram, ServingMetrics, parse_text

# One sample line of the text format: name{labels} value
_SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\})? '
                     r'(-?[0-9.e+-]+|\+Inf|-Inf|NaN)$')


def test_histogram_is_cumulative_with_inf_sum_and_count():
    h = Histogram("x_seconds", "help", (0.1, 1.0))
    for v in (0.05, 0.5, 0.5, 3.0):
        h.observe(v)
    h.observe(0.2, count=2)
    s = parse_text("\n".join(h.render()))
    assert s['x_seconds_bucket{le="0.1"}'] == 1
    assert s['x_seconds_bucket{le="1"}'] == 5
    assert s['x_seconds_bucket{le="+Inf"}'] == 6
    assert s["x_seconds_count"] == 6
    assert s["x_seconds_sum"] == pytest.approx(0.05 + 1.0 + 3.0 + 0.4)


def test_counter_labels_and_escaping():
    c = Counter("reqs_total", "help", ("reason",))
    c.inc(labels={"reason": 'a"b\\c\nd'})
    c.inc(2, labels={"reason": "ok"})
    lines = c.render()
    assert lines[:2] == ["# HELP reqs help", "# TYPE reqs counter"]
    assert 'reqs_total{reason="a\\"b\\\\c\\nd"} 1' in lines
    assert 'reqs_total{reason="ok"} 2' in lines
    with pytest.raises(ValueError, match="only go up"):
        c.inc(-1, labels={"reason": "ok"})
    with pytest.raises(ValueError, match="labels"):
        c.inc()
    with pytest.raises(ValueError, match="_total"):
        Counter("reqs", "help")


def test_serving_metrics_render_is_valid_exposition_text():
    m = ServingMetrics()
    m.ttft.observe(0.03)
    m.requests_finished.inc(labels={"finish_reason": "stop"})
    text = m.render({"running": 2, "waiting": 1, "kv_pages_used": 10, "kv_pages_total": 40,
                     "prefix_cache_hit_tokens": 30, "prefix_cache_query_tokens": 120, "flag": True, "name": "x"})
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or _SAMPLE.match(line), line
    s = parse_text(text)
    assert s["dsv41_kv_cache_usage_ratio"] == 0.25
    assert s["dsv41_prefix_cache_hit_rate"] == 0.25
    assert s["dsv41_num_requests_running"] == 2 and s["dsv41_num_requests_waiting"] == 1
    assert s["dsv41_engine_kv_pages_used"] == 10
    assert "dsv41_engine_flag" not in s and "dsv41_engine_name" not in s
    assert s["dsv41_time_to_first_token_seconds_count"] == 1
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(names) == len(set(names)), "a metric family is declared twice"


def test_gauge():
    g = Gauge("g", "help")
    assert g.render() == []
    g.set(3.5)
    assert parse_text("\n".join(g.render())) == {"g": 3.5}
