"""The server during warm-up: the port is open, /health answers 503 with the progress and generation requests
503 + Retry-After until the engine is ready, then 200; stopping the server mid-warm-up ends it promptly."""

from __future__ import annotations

import json
import threading
import time

from fake_engine import FakeEngine
from serving_helpers import MODEL, get, post

from serving.api import BackgroundServer

BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 2}


def _until(cond, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return got


def _health(srv) -> tuple[int, dict]:
    status, text = get(srv, "/health")
    return status, json.loads(text)


def test_health_reports_warmup_progress_then_ok():
    eng = FakeEngine(warmup_programs=3)
    eng.warmup_gate = threading.Semaphore(0)  # each release lets one program through
    with BackgroundServer(eng, model_name=MODEL, warmup=True) as srv:
        assert _health(srv) == (503, {"status": "warming up", "programs_ready": 0, "programs": 3,
                                      "programs_compiled": 0, "eta_s": None})
        status, headers, body = post(srv, "/v1/completions", BODY)
        assert status == 503 and body["error"]["code"] == "warming_up" and int(headers["Retry-After"]) >= 1
        assert "0 of 3 programs" in body["error"]["message"]
        status, headers, body = post(srv, "/v1/chat/completions",
                                     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert status == 503 and body["error"]["code"] == "warming_up"
        assert get(srv, "/metrics")[0] == 200  # does not wait for the engine thread, which is busy warming up

        eng.warmup_gate.release()
        _until(lambda: _health(srv)[1].get("programs_ready") == 1)
        status, body = _health(srv)
        assert status == 503 and body["status"] == "warming up" and body["programs"] == 3

        eng.warmup_gate.release(2)
        _until(lambda: _health(srv)[0] == 200)
        assert _health(srv) == (200, {"status": "ok"})
        status, _, body = post(srv, "/v1/completions", BODY)
        assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_staged_warmup_serves_while_the_rest_compile():
    """With a staged warm-up the server takes requests once the covering programs are ready: /health answers 200
    and says how many programs are ready until the rest are (the fake engine readies one a step)."""
    eng = FakeEngine(warmup_programs=3)
    eng.warmup_gate = threading.Semaphore(0)
    with BackgroundServer(eng, model_name=MODEL, warmup=True, staged_warmup=True) as srv:
        assert _health(srv)[0] == 503
        eng.warmup_gate.release()  # the first program: the fake engine's covering set
        _until(lambda: _health(srv)[0] == 200)
        assert _health(srv) == (200, {"status": "ok", "programs_ready": 1, "programs": 3})
        status, _, body = post(srv, "/v1/completions", BODY)  # its steps ready the other two
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        _until(lambda: _health(srv)[1] == {"status": "ok"})


def test_stopping_during_warmup_ends_it():
    """SIGTERM while warming: uvicorn's shutdown stops the engine thread between two programs, not after all."""
    eng = FakeEngine(warmup_programs=50)
    eng.warmup_gate = threading.Semaphore(0)  # held: warm-up never finishes by itself
    srv = BackgroundServer(eng, model_name=MODEL, warmup=True).start()
    assert _health(srv)[0] == 503
    t0 = time.monotonic()
    srv.stop()
    assert not srv.async_engine._thread.is_alive() and time.monotonic() - t0 < 10
    assert eng.warmup_progress.snapshot()["programs_ready"] == 0


def test_without_warmup_the_server_is_ready_at_once(fake_server):
    assert _health(fake_server) == (200, {"status": "ok"})
