from __future__ import annotations

import argparse

import pytest

from serving.cli_serve import add_bench_args, add_serve_args, bench_config, engine_kwargs, run_bench, served_model_name


def _serve(argv):
    return add_serve_args(argparse.ArgumentParser()).parse_args(argv)


def test_serve_flags_map_to_engine_kwargs():
    args = _serve(["--preset", "tiny", "--port", "9001", "--max-model-len", "2048", "--max-num-seqs", "4",
                   "--max-num-batched-tokens", "256", "--no-swa-bounded-replay", "--no-enable-prefix-caching",
                   "--swa-replay-tokens", "256"])
    assert (args.host, args.port) == ("127.0.0.1", 9001)
    assert engine_kwargs(args) == {"max_model_len": 2048, "max_num_seqs": 4, "max_num_batched_tokens": 256,
                                   "swa_bounded_replay": False, "enable_prefix_caching": False,
                                   "swa_replay_tokens": 256}
    assert engine_kwargs(_serve([])) == {}
    assert engine_kwargs(_serve(["--batch-invariant"])) == {"batch_invariant": True}
    assert engine_kwargs(_serve(["--no-async-scheduling"])) == {"async_scheduling": False}
    assert engine_kwargs(_serve(["--device-feed"])) == {"device_feed": True}
    assert engine_kwargs(_serve(["--all2all-backend", "ragged_all_to_all"])) == {"all2all_backend": "ragged_all_to_all"}
    assert engine_kwargs(_serve(["--max-prefill-rows", "1"])) == {"max_prefill_rows": 1}
    assert served_model_name(args) == "tiny"
    assert served_model_name(_serve(["--checkpoint", "/ckpt/flash/"])) == "flash"
    assert (_serve([]).engram_tables, _serve(["--engram-tables", "mmap"]).engram_tables) == ("ram", "mmap")


def test_serve_flag_errors_name_the_flag():
    with pytest.raises(SystemExit, match="--attention-backend: not supported"):
        engine_kwargs(_serve(["--attention-backend", "pallas"]), accepted={"max_model_len"})
    with pytest.raises(SystemExit, match="--max-num-seqs 0"):
        engine_kwargs(_serve(["--max-num-seqs", "0"]))
    with pytest.raises(SystemExit):  # argparse: --checkpoint and --preset exclude each other
        _serve(["--checkpoint", "x", "--preset", "tiny"])


def test_speculative_config_flag():
    from serving.engine.config import SpeculativeConfig

    kw = engine_kwargs(_serve(["--speculative-config", '{"method": "dspark", "num_speculative_tokens": 3}']))
    assert kw == {"speculative_config": SpeculativeConfig(num_speculative_tokens=3)}
    with pytest.raises(SystemExit, match="not valid JSON"):
        engine_kwargs(_serve(["--speculative-config", "dspark"]))
    with pytest.raises(SystemExit, match="only 'dspark'"):
        engine_kwargs(_serve(["--speculative-config", '{"method": "ngram"}']))


def test_bench_flags(fake_server, tmp_path):
    parser = add_bench_args(argparse.ArgumentParser())
    args = parser.parse_args(["--base-url", fake_server.base_url, "--max-concurrency", "1,2", "--num-sessions", "2",
                              "--num-turns", "2", "--think-time", "0", "--shared-prefix-len", "20", "--input-len", "5",
                              "--turn-input-len", "3", "--output-len", "2", "--metric-percentiles", "50,95",
                              "--num-warmups", "1"])
    cfg = bench_config(args)
    assert cfg.max_concurrency == (1, 2) and cfg.percentiles == (50.0, 95.0) and cfg.ignore_eos
    assert cfg.num_warmups == 1
    assert run_bench(args) == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-concurrency", "0"])
    dead = parser.parse_args(["--port", "1", "--num-turns", "1", "--max-concurrency", "1", "--request-timeout", "5"])
    assert run_bench(dead) == 1  # nothing listens there: a clear log line, exit 1


def test_server_flags():
    from serving.cli_serve import check_server_args

    args = _serve(["--max-queue-wait", "2.5", "--no-access-log"])
    assert args.max_queue_wait == 2.5 and args.access_log is False
    assert _serve([]).max_queue_wait is None and _serve([]).access_log is True
    check_server_args(args)
    with pytest.raises(SystemExit, match="--max-queue-wait 0"):
        check_server_args(_serve(["--max-queue-wait", "0"]))


_SERVE_FAKE = """
import sys
sys.path.insert(0, "tests/serving")
from fake_engine import FakeEngine
from serving.cli_serve import _ensure_logging, _serve_forever, add_serve_args
import argparse
_ensure_logging()
args = add_serve_args(argparse.ArgumentParser()).parse_args(["--port", sys.argv[1], "--max-queue-wait", "30"])
_serve_forever(FakeEngine(step_delay_s=0.005), args)
"""


def test_sigterm_drains_the_requests_in_flight(tmp_path):
    """`dsv41 serve` under uvicorn: SIGTERM stops new connections, lets a stream in flight finish, then exits."""
    import http.client
    import signal
    import time

    proc, port = _start_server(_SERVE_FAKE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                conn.request("POST", "/v1/completions", '{"prompt": "drain me", "max_tokens": 200, "stream": true, '
                             '"ignore_eos": true}', {"Content-Type": "application/json"})
                resp = conn.getresponse()
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read().decode()
                time.sleep(0.1)
        assert resp.status == 200
        resp.readline()  # the first token is out: the request is in flight
        proc.send_signal(signal.SIGTERM)
        events = [line for line in resp.read().split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]" and len(events) >= 150, events[-3:]
        # uvicorn re-raises the signal once it has drained, so the parent sees how the server ended
        assert proc.wait(60) in (0, -signal.SIGTERM)
        out = proc.stdout.read().decode()
        assert '"POST /v1/completions" 200' in out and "output_tokens=200" in out, out  # the access log line
    finally:
        if proc.poll() is None:
            proc.kill()


def _start_server(script: str):
    """Runs a server script (`_SERVE_FAKE*`) on a free port in a subprocess. -> (process, port)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess.Popen([sys.executable, "-c", script, str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT), port


_SERVE_FAKE_WARMING = """
import sys
sys.path.insert(0, "tests/serving")
from fake_engine import FakeEngine
from serving.cli_serve import _ensure_logging, _serve_forever, add_serve_args
import argparse
_ensure_logging()
args = add_serve_args(argparse.ArgumentParser()).parse_args(["--port", sys.argv[1], "--no-serve-during-warmup"])
_serve_forever(FakeEngine(warmup_programs=10000, warmup_delay_s=0.05), args, warmup=True)
"""


def test_sigterm_during_warmup_exits_promptly():
    """`dsv41 serve --warmup --no-serve-during-warmup`: the port answers /health with the progress while warming,
    and SIGTERM then ends the server between two programs rather than after all of them."""
    import json
    import signal
    import time
    import urllib.error
    import urllib.request

    proc, port = _start_server(_SERVE_FAKE_WARMING)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
                raise AssertionError("healthy before warm-up ended")
            except urllib.error.HTTPError as e:
                body = json.loads(e.read())
                assert e.code == 503 and e.headers["Retry-After"], body
                if body["programs_ready"] >= 1:
                    break
            except (ConnectionRefusedError, urllib.error.URLError):
                pass
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.1)
        assert body["status"] == "warming up" and body["programs"] == 10000
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) in (0, -signal.SIGTERM)
        assert "did not stop" not in proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
