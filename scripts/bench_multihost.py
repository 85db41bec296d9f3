"""The per-step cost of driving a multi-host engine (serving/multihost.py), between two processes on this host:
the side channel's round trip for a step frame of each size against `multihost_utils.broadcast_one_to_all` of the
same bytes (a device collective: what the step frame would cost sent that way), then the frames of a served run of
the tiny preset (DP2 + EP, a data rank per process): bytes per step and the leader's time to send them.

    PYTHONPATH=. python3 scripts/bench_multihost.py                  # CPU, ~1 min
    PYTHONPATH=. python3 scripts/bench_multihost.py --devices 4      # 4 devices a process (DP2 x TP4 + EP)
    PYTHONPATH=. python3 scripts/bench_multihost.py --gpu --devices 4  # 8 GPUs: 4 a process (CUDA_VISIBLE_DEVICES)

Both processes run on this host; across hosts the side channel's round trip adds the network's."""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

from timing import print_table  # noqa: I001 (first: puts the repository on sys.path)
import numpy as np
from jax.experimental import multihost_utils

from serving import multihost
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine
from serving.engine.sampling import SamplingParams

SIZES = (64, 1024, 16384)  # bytes: a decode step's frame, one new request, a long prompt's new request


def child(pid: int, port: int, devices: int, out: str) -> int:
    cluster = multihost.initialize(multihost.Cluster(2, pid, f"127.0.0.1:{port}"))
    lock = threading.Lock()
    # the raw side channel: round trips of a frame of each size
    if pid == 0:
        srv = socket.create_server(("127.0.0.1", port + 2))
        sock, _ = srv.accept()
    else:
        for _ in range(200):
            try:
                sock = socket.create_connection(("127.0.0.1", port + 2))
                break
            except OSError:
                time.sleep(0.05)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rows = []
    for size in SIZES:
        msg = {"op": "step", "events": "x" * size}
        rtt = []
        for i in range(300):
            t = time.perf_counter()
            if pid == 0:
                multihost._send(sock, msg, lock)
                multihost._recv(sock)
            else:
                multihost._send(sock, multihost._recv(sock), lock)
            rtt.append(time.perf_counter() - t)
        payload = np.zeros(size, np.uint8)
        bc = []
        for i in range(30):
            t = time.perf_counter()
            multihost_utils.broadcast_one_to_all(payload)
            bc.append(time.perf_counter() - t)
        rows.append((size, statistics.median(rtt[20:]), statistics.median(bc[5:])))
    sock.close()

    config = EngineConfig(max_num_seqs=4, max_model_len=256, data_parallel_size=2, tensor_parallel_size=devices,
                          enable_expert_parallel=True, min_prefill_bucket=64, min_decode_bucket=2)
    frames = []

    def lead(leader) -> int:
        rng = np.random.default_rng(0)
        for i in range(8):
            leader.add_request(f"r{i}", rng.integers(3, 1000, 60).tolist(), SamplingParams(max_tokens=24,
                                                                                          ignore_eos=True))
        while leader.has_work():
            t = time.perf_counter()
            leader.step()
            frames.append((leader.frame_bytes, leader.send_s, time.perf_counter() - t))
        return 0

    status = multihost.run(cluster, lambda: Engine.from_preset("tiny", config=config), lead)
    if pid == 0:
        with open(out, "w") as f:
            json.dump({"channel": rows, "frames": frames}, f)
    return status


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=1, help="devices a process (the tensor-parallel size)")
    ap.add_argument("--gpu", action="store_true", help="GPUs: process i gets GPUs [i * devices, (i + 1) * devices)")
    ap.add_argument("--child", type=int, nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="/tmp/bench_multihost.json")
    a = ap.parse_args()
    if a.child:
        return child(*a.child, a.devices, a.out)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i in (1, 0):
        env = dict(os.environ)
        if a.gpu:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i * a.devices + k) for k in range(a.devices))
        else:
            env["JAX_PLATFORMS"] = "cpu"
            env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={a.devices}"
        procs.append(subprocess.Popen([sys.executable, __file__, "--child", str(i), str(port), "--devices",
                                       str(a.devices), "--out", a.out], env=env))
    if any(p.wait() for p in procs):
        print("a process failed; see its log above", file=sys.stderr)
        return 1
    res = json.load(open(a.out))
    print("\nside channel round trip vs broadcast_one_to_all, per step frame (medians)\n")
    print_table(["frame bytes", "side channel round trip (us)", "broadcast_one_to_all (us)"],
                [[n, f"{r * 1e6:.0f}", f"{b * 1e6:.0f}"] for n, r, b in res["channel"]])
    fr = res["frames"][2:]  # times: past the first steps, which compile
    print(f"\nserved run: {len(res['frames'])} steps of the tiny preset, DP2 x TP{a.devices} + EP over 2 processes\n")
    print_table(["", "median", "max"], [
        ["frame bytes / step (all followers)", statistics.median(f[0] for f in fr), max(f[0] for f in res["frames"])],
        *([what, f"{statistics.median(f[i] for f in fr) * k:.{d}f}", f"{max(f[i] for f in fr) * k:.{d}f}"]
          for what, i, k, d in (("leader send (us)", 1, 1e6, 0), ("step (ms)", 2, 1e3, 1)))])
    return 0


if __name__ == "__main__":
    sys.exit(main())
