"""What launching a program's CUDA graph costs a node, apart from the model: one jitted program of K steps in a
chain, each step two kernels, called again and again on the same inputs, its host time (until the call returns:
XLA has launched the command buffer's graph) and its wall time (to the result), median ms.

- `xla`: each step two XLA fusions (elementwise ops kept apart by optimization barriers).
- `mosaic`: each step the FP8 linear kernel (`pallas_kernels.fp8_linear`, one row, 5120 -> 1280) and one XLA
  fusion (its output added back to the row), so the graph holds K Mosaic GPU kernels among its nodes.

Each way runs with the previous call's output dropped before the next call (its buffer is reused: nothing in the
graph to update) and kept (the output lands at a new address, as a decode step's tokens do while the engine reads
the previous step's: XLA updates the graph's nodes before it launches it). The decode step's graph launch costs
~3 us a node on the H100 (docs/PERFORMANCE.md section 2); this says whether that is the graph's size itself, the
Mosaic GPU kernels in it or the updates.

    PYTHONPATH=. python3 scripts/bench_graph_launch.py --steps 100,300 [--reps 50]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import timing  # noqa: I001  (first: puts the repository on sys.path)
import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import quant
from pallas_kernels import fp8_linear
from timing import print_table

log = logging.getLogger("bench_graph_launch")

DIM, OUT = 5120, 1280  # Flash's q-LoRA down-projection: the FP8 linear kernel's decode shape


def xla_chain(steps: int):
    def f(x, w):
        for i in range(steps):
            for j in range(2):
                x = jax.lax.optimization_barrier(x * (1.0 + 1e-3 * j) + 1e-3 * i)
        return x
    return jax.jit(f)


def mosaic_chain(steps: int, interpret: bool):
    def f(x, w):
        for _ in range(steps):
            y = fp8_linear.fp8_linear(x, w)  # [1, OUT]
            x = jax.lax.optimization_barrier(x + 1e-3 * jnp.pad(y, ((0, 0), (0, DIM - OUT))))
        return x
    return jax.jit(f)


def weight(interpret: bool):
    w = jax.random.normal(jax.random.key(0), (OUT, DIM), jnp.float32) * DIM ** -0.5
    return fp8_linear.prepare_fp8_linear(quant.quantize_fp8_weight(w), interpret=interpret)


def measure(fn, x, w, reps: int, keep: bool) -> tuple[float, float]:
    """-> (median host ms a call, median wall ms a call). keep: the previous output stays alive during a call."""
    host, wall = [], []
    prev = fn(x, w).block_until_ready()
    for _ in range(reps):
        if not keep:
            prev = None
        t0 = time.perf_counter()
        out = fn(x, w)
        t1 = time.perf_counter()
        out.block_until_ready()
        t2 = time.perf_counter()
        host.append(t1 - t0)
        wall.append(t2 - t0)
        prev = out  # noqa: F841 (kept alive, or dropped above)
    return statistics.median(host) * 1e3, statistics.median(wall) * 1e3


def main():
    ap = timing.bench_args(__doc__)
    ap.add_argument("--steps", default="100,300", help="chain lengths (two kernels a step)")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    interpret = jax.default_backend() == "cpu"  # a CPU smoke run: the kernel in the Mosaic GPU interpreter
    w = weight(interpret)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, DIM)), jnp.bfloat16)
    rows = []
    for steps in [int(s) for s in args.steps.split(",")]:
        for way, make in (("xla", xla_chain), ("mosaic", lambda n: mosaic_chain(n, interpret))):
            fn = make(steps)
            t = time.perf_counter()
            fn(x, w).block_until_ready()
            log.info("%s %d steps: compiled and ran in %.1f s", way, steps, time.perf_counter() - t)
            for keep in (False, True):
                host, wall = measure(fn, x, w, args.reps, keep)
                rows.append([way, steps, 2 * steps, "kept" if keep else "dropped", f"{host:.3f}", f"{wall:.3f}",
                             f"{1e3 * host / (2 * steps):.2f}"])
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}\n")
    print_table(["kernels", "steps", "kernels a call", "previous output", "host ms a call", "wall ms a call",
                 "host us a kernel"], rows)
    timing.write_json(args.out, "bench_graph_launch.json", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
