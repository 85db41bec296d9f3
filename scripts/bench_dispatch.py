"""Whether a program's call returns once launched: the host time of a call against the program's device time, for
a chain of GEMMs (device work of several ms) followed by each of the ops a sampling step runs on vocabulary rows.

A fed decode step overlaps the next step's launch with this one only if the call returns before the device is
done. A speculative step with sampled rows (the filtering program: sorts of [rows, V] probabilities) held the host
(docs/PERFORMANCE.md section 5, DSpark). The first suspect was XLA's cub radix sort (`CubSortThunk`), which for a
batch of rows copies the rows' offsets from a host vector to the device in stream order; this separates the ops,
the sort of a batch of rows from that of one row, and cleared it: every op's call returns at launch, with cub
sorts or XLA's own (`--xla_gpu_enable_cub_radix_sort=false`). The hold is XLA's update of the step's CUDA graphs
at every fed call (section 5).

    PYTHONPATH=. python3 scripts/bench_dispatch.py --rows 11 --vocab 129280

prints, per tail op: the call's host time, the time to the result, and their ratio (near 0: the call returns at
launch; near 1: the host waits for the device inside the call), medians of --reps calls, and two calls queued back
to back (the second call's host time: whether it waits for the first's work).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from timing import print_table


def tails(k: int):
    """name -> f(logits [R, V] float32, key) -> a small result, the op as sampling code runs it."""
    return {
        "none (GEMMs only)": lambda lg, key: lg[:, 0],
        "argmax": lambda lg, key: jnp.argmax(lg, -1),
        "categorical": lambda lg, key: jax.random.categorical(key, lg),
        "sort": lambda lg, key: jnp.sort(lg, -1)[:, -1],
        # one row: XLA's cub sort copies its rows' offsets from the host for a batch of rows only (CubSortThunk)
        "sort, one row": lambda lg, key: jnp.sort(lg[:1], -1)[:, -1],
        "argsort": lambda lg, key: jnp.argsort(-lg, -1)[:, 0],
        f"lax.top_k {k}": lambda lg, key: jax.lax.top_k(lg, k)[1][:, 0],
        "cumsum of sorted": lambda lg, key: jnp.cumsum(jax.nn.softmax(jnp.sort(lg, -1), -1), -1)[:, -2],
    }


def program(tail, gemms: int, rows: int):
    @jax.jit
    def f(x, w, head, key):
        for _ in range(gemms):  # unrolled: a loop on the device would itself be a host round trip
            x = jnp.tanh(x @ w)
        return tail((x[:rows] @ head).astype(jnp.float32), key)  # logits [rows, V]
    return f


def call_and_result_s(f, args, reps: int) -> tuple[float, float, float]:
    """-> median (call s, to-result s, second queued call s)."""
    jax.block_until_ready(f(*args))
    calls, totals, seconds = [], [], []
    for _ in range(reps):
        t = time.perf_counter()
        y = f(*args)
        calls.append(time.perf_counter() - t)
        jax.block_until_ready(y)
        totals.append(time.perf_counter() - t)
        y1 = f(*args)
        t = time.perf_counter()
        y2 = f(*args)
        seconds.append(time.perf_counter() - t)
        jax.block_until_ready((y1, y2))
    return statistics.median(calls), statistics.median(totals), statistics.median(seconds)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=11, help="vocabulary rows (a batch-1 speculative step: k + 1 + k)")
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--gemms", type=int, default=40, help="GEMMs of [2048, 4096] x [4096, 4096] before the tail")
    ap.add_argument("--top-k", type=int, default=64)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--only", default="", help="comma-separated tail names (default: all)")
    args = ap.parse_args()
    kx, kw, kh, key = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (2048, 4096), jnp.bfloat16)
    w = (jax.random.normal(kw, (4096, 4096), jnp.float32) / 64).astype(jnp.bfloat16)
    head = jax.random.normal(kh, (4096, args.vocab), jnp.bfloat16) / 64
    only = set(filter(None, args.only.split(",")))
    rows = []
    for name, tail in tails(args.top_k).items():
        if only and name not in only:
            continue
        f = program(tail, args.gemms, args.rows)
        call, total, second = call_and_result_s(f, (x, w, head, key), args.reps)
        rows.append([name, f"{call * 1e3:.3f}", f"{total * 1e3:.3f}", f"{call / total:.2f}", f"{second * 1e3:.3f}"])
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, {args.gemms} GEMMs then [{args.rows}, "
          f"{args.vocab}] float32 rows, {time.strftime('%F')}\n")
    print_table(["tail op", "call ms", "to result ms", "call / result", "2nd queued call ms"], rows)


if __name__ == "__main__":
    main()
