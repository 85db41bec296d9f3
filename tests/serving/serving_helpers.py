"""Helpers for the serving tests: raw HTTP calls and engine stats of a BackgroundServer."""

from __future__ import annotations

import http.client
import json
from typing import Any

from serving.api import BackgroundServer

MODEL = "tiny"


def post(srv: BackgroundServer, path: str, body: Any = None, *, raw: bytes | None = None,
         headers: dict[str, str] | None = None, conn: http.client.HTTPConnection | None = None
         ) -> tuple[int, Any, Any]:
    """(status, headers, parsed JSON body or text) of one POST."""
    own = conn is None
    conn = conn or http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    text = resp.read().decode()
    if own:
        conn.close()
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        parsed = text
    return resp.status, resp.headers, parsed  # an HTTPMessage: header names match in any case


def get(srv: BackgroundServer, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    conn.request("GET", path)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, text


def engine_stats(srv: BackgroundServer) -> dict[str, Any]:
    """Fresh Engine.stats(), taken on the engine thread."""
    return srv.async_engine.call_in_engine_thread(lambda e: e.stats())


def scrape(srv: BackgroundServer) -> dict[str, Any]:
    """GET /metrics read by Prometheus' own parser: {family name: Metric}."""
    from prometheus_client.parser import text_string_to_metric_families

    code, text = get(srv, "/metrics")
    assert code == 200, text
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(families: dict[str, Any], name: str, **labels: str) -> float:
    """The value of sample `name` whose labels include `labels` (summed over the rest); 0 when absent."""
    family = name.removesuffix("_total").removesuffix("_count").removesuffix("_sum").removesuffix("_bucket")
    fam = families.get(family)
    return sum(s.value for s in (fam.samples if fam else ()) if s.name == name
               and all(s.labels.get(k) == v for k, v in labels.items()))
