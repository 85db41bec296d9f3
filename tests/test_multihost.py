"""`dsv41 serve` over two processes on localhost (serving/multihost.py), two CPU devices each, exchanging data
through gloo.

- With DEP (a data rank per process, TP2 inside it, experts over all four devices) a greedy completion is the
  one of the same engine in one process (this test's own devices); with `DSV41_TEST_MULTIHOST_FEED=1` also with
  `--device-feed` (each process's Engram row block, the tokens fed on the device). A tensor-parallel server across
  both processes (TP4: the tiny preset splits its output groups at most 4 ways) starts and stops; its completion is
  not run here (its compile in two processes costs CI time; `DSV41_TEST_MULTIHOST_TP=1` runs it).
- /health lists both processes. After SIGTERM process 0 drains and process 1 leaves cleanly (exit 0); a killed
  process 1 makes process 0 answer 503 naming it and exit with EXIT_LOST.
- In one process, over the side channel: a follower built with other options is refused naming the option; one
  whose scheduler state diverged stops and the leader hears why.

Built for the fewest compiles: one prompt token with exact prefill, so prefill and decode run one program shape.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request

import jax
import pytest

from serving import cli_serve, multihost
from serving.engine.sampling import SamplingParams
from serving.response import TextPipeline

pytestmark = [pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (XLA_FLAGS host device count)"),
              pytest.mark.xdist_group("multihost")]  # one worker starts the servers (a module fixture per worker)
ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT_S = 240
CACHE = ROOT / ".jax_cache"  # the persistent compilation cache tests/conftest.py gives this process
LAYOUTS = {"tp": ["--tensor-parallel-size", "4"],
           "dep": ["--data-parallel-size", "2", "--tensor-parallel-size", "2", "--enable-expert-parallel"]}
ANSWERED = ["dep", "tp"] if os.environ.get("DSV41_TEST_MULTIHOST_TP") == "1" else ["dep"]  # layouts asked to complete
if os.environ.get("DSV41_TEST_MULTIHOST_FEED") == "1":  # decode tokens fed on the device across processes (CI time)
    LAYOUTS["dep+feed"] = [*LAYOUTS["dep"], "--device-feed"]
    ANSWERED.append("dep+feed")
ENGINE = ["--preset", "tiny", "--max-model-len", "128", "--max-num-seqs", "1", "--no-swa-bounded-replay",
          "--min-prefill-bucket", "1", "--min-decode-bucket", "1"]
PROMPT, MAX_TOKENS = [1], 6
COMPLETION = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
              "skip_special_tokens": False}


def free_ports(n: int) -> list[int]:
    """n ports p with p + 1 free too (jax's coordinator, then the engine's side channel; or HTTP), drawn outside the
    kernel's ephemeral range: a port the kernel hands out (a bind to port 0, an outgoing connection of another test)
    could be taken again by another test's connection between this check and the server's bind."""
    try:
        low, high = map(int, pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2])
    except (OSError, ValueError):
        low, high = 32768, 60999
    span = (10000, low - 1) if low > 12000 else (high + 1, 65534)  # below the range, or above it
    rng, out = random.Random(), []
    while len(out) < n:
        p = rng.randrange(*span)
        if {p, p + 1} & {q + i for q in out for i in (0, 1)}:
            continue
        socks = []
        try:
            for q in (p, p + 1):
                socks.append(socket.socket())
                socks[-1].bind(("", q))
            out.append(p)
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    return out


def logs(tmp_path, name: str) -> str:
    return "".join(f"\n--- process {i}\n" + (tmp_path / f"{name}-{i}.log").read_text()[-3000:] for i in (0, 1))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """layout -> (base URL, [process 0, process 1], log folder): a two-process server per layout, healthy."""
    tmp = tmp_path_factory.mktemp("multihost")
    # this process's XLA flags (tests/conftest.py: fast compiles), two devices a process
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "DSV41_COMPILATION_CACHE": str(CACHE),
           "XLA_FLAGS": " ".join(["--xla_force_host_platform_device_count=2", *flags])}
    out = {}
    for name, flags in LAYOUTS.items():
        coord, http = free_ports(2)
        procs = []
        for i in (1, 0):
            argv = [sys.executable, "-m", "serving.cli", "serve", *ENGINE, *flags, "--num-processes", "2",
                    "--process-id", str(i), "--coordinator-address", f"127.0.0.1:{coord}", "--port", str(http),
                    "--no-access-log"]
            log = open(tmp / f"{name}-{i}.log", "w")
            procs.insert(0, subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        out[name] = (f"http://127.0.0.1:{http}", procs, tmp)
    pool = concurrent.futures.ThreadPoolExecutor(len(out))
    try:
        for name, (url, procs, tmp) in out.items():
            body = wait_healthy(url, procs, tmp, name)
            assert [p["process"] for p in body["processes"]] == [0, 1], body
            assert all(p["alive"] for p in body["processes"]), body
        # the ANSWERED layouts compile and answer while this process builds the reference
        yield {name: (*v, pool.submit(request, v[0] + "/v1/completions", COMPLETION) if name in ANSWERED else None)
               for name, v in out.items()}
    finally:
        for _, procs, _ in out.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
        pool.shutdown(wait=False, cancel_futures=True)


def request(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_healthy(url: str, procs, tmp, name: str) -> dict:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            pytest.fail(f"{name}: a process exited early{logs(tmp, name)}")
        try:
            code, body = request(url + "/health")
            if code == 200:
                return body
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    pytest.fail(f"{name}: /health never answered 200{logs(tmp, name)}")


@pytest.fixture(scope="module")
def one_device_text():
    """(tokens, text) of the same engine on one device: a layout's greedy tokens are the one-device engine's
    (tests/test_engine_mesh.py), so one reference serves every layout (and compiles once)."""
    args = cli_serve.add_serve_args(argparse.ArgumentParser()).parse_args(ENGINE)
    eng = cli_serve.build_engine(args)
    ref = eng.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return ref, TextPipeline(eng.tokenizer, stop=(), stop_token_ids=(), skip_special_tokens=False).feed(
        ref, finished=True, finish_reason="length")


@pytest.mark.parametrize("layout", ANSWERED)
def test_two_processes_serve_the_one_device_tokens(layout, servers, one_device_text):
    url, _, tmp, answer = servers[layout]
    ref, text = one_device_text
    code, body = answer.result(TIMEOUT_S)
    assert code == 200, f"{body}{logs(tmp, layout)}"
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    assert body["choices"][0]["text"] == text, (ref, body)


def test_sigterm_drains_and_stops_every_process(servers):
    url, (leader, worker), tmp, answer = servers["tp"]
    if answer is not None:
        answer.result(TIMEOUT_S)
    leader.send_signal(signal.SIGTERM)
    assert worker.wait(TIMEOUT_S) == 0, logs(tmp, "tp")
    leader.wait(TIMEOUT_S)  # uvicorn re-raises the SIGTERM it drained on: the status is the signal's
    assert "every process stopped" in (tmp / "tp-0.log").read_text()


def test_a_lost_process_fails_requests_with_503_and_stops_the_server(servers):
    url, (leader, worker), tmp, answer = servers["dep"]
    answer.result(TIMEOUT_S)
    worker.kill()
    worker.wait()
    deadline = time.monotonic() + 10
    while True:
        code, body = request(url + "/health")
        if code == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert code == 503 and "lost process 1 of 2" in body["error"]["message"], (code, body)
    code, body = request(url + "/v1/completions", {"model": "tiny", "prompt": PROMPT})
    assert code == 503 and "lost process 1 of 2" in body["error"]["message"], (code, body)
    assert leader.wait(TIMEOUT_S) == multihost.EXIT_LOST
    assert "lost process 1 of 2" in (tmp / "dep-0.log").read_text()


def linked_pair():
    """The leader's Links and a follower's (peer, frames) over a local side channel, and the losses each saw."""
    coord = free_ports(1)[0]
    leader = multihost.Cluster(num_processes=2, process_id=0, coordinator_address=f"127.0.0.1:{coord}")
    lost: dict[str, list] = {"leader": [], "follower": []}
    box = []
    t = threading.Thread(target=lambda: box.append(multihost.connect(dataclasses.replace(leader, process_id=1),
                                                                     lost["follower"].append)))
    t.start()
    links = multihost.Links(leader, lambda i, why: lost["leader"].append((i, why)))
    t.join()
    return links, *box[0], lost


def test_a_follower_built_with_other_options_is_named_before_anything_runs():
    links, peer, frames, lost = linked_pair()
    peer.send({"op": "ready", "fingerprint": {"max_model_len": "128", "numerics": "x"}})
    with pytest.raises(multihost.LostProcess, match="process 1 of 2 built a different engine: max_model_len: "
                                                   "process 0 256, process 1 128. Start every process"):
        links.check_same_engine({"max_model_len": "256", "numerics": "x"}, timeout_s=10)
    assert not lost["leader"] and not lost["follower"]


def test_a_follower_whose_scheduler_diverged_stops_and_the_leader_hears_why():
    links, peer, frames, lost = linked_pair()
    engine = types.SimpleNamespace(running={}, waiting=[])
    links.send_all({"op": "step", "seq": 1, "events": [], "digest": multihost.digest(engine) + 1})
    with pytest.raises(multihost.LostProcess, match="scheduler state differs from the leader's before step 1"):
        multihost.follow(engine, peer, frames)
    deadline = time.monotonic() + 10
    while not lost["leader"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lost["leader"] and lost["leader"][0][0] == 1 and "scheduler state differs" in lost["leader"][0][1]


def test_a_request_with_an_image_reaches_the_follower_as_the_leader_prepared_it():
    """Followers get the leader's prepared tower inputs and digest (not the URL: a fetch could differ by host)."""
    import numpy as np
    from PIL import Image

    from dsv41 import image_processing as ip
    from dsv41.config import preset
    from serving.engine.images import PromptImage

    v = preset("tiny").vision
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (28, 40, 3), dtype=np.uint8), "RGB")
    im = PromptImage.of(5, b"the encoded bytes", ip.preprocess(img, v), v)
    back = multihost._image_from_json(json.loads(json.dumps(multihost._image_to_json(im))))
    assert (back.start, back.digest, back.inputs.span_len) == (im.start, im.digest, im.inputs.span_len)
    for f in ("patches", "pos", "valid", "merge", "types"):
        a, b = getattr(im.inputs, f), getattr(back.inputs, f)
        assert a.dtype == b.dtype and np.array_equal(a, b), f
