"""The fused router and mHC site kernels called many times on the same inputs: counts the calls whose outputs are
not bit-identical to the first call. A race in a kernel shows as rare differing calls.

    PYTHONPATH=. python3 scripts/check_site_kernels_repeat.py --reps 50
    .venv/bin/python scripts/check_site_kernels_repeat.py --interpret --reps 2   # CPU: the script's logic
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from bench_mhc import make_inputs  # noqa: E402
from dsv41.config import ModelConfig  # noqa: E402
from pallas_kernels import mhc as M  # noqa: E402
from pallas_kernels import router as R  # noqa: E402


def _equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _count(name, call, small: dict, rest: tuple, reps: int) -> None:
    """call(small, *rest), reps times."""
    plain = jax.jit(call)
    first = jax.block_until_ready(plain(small, *rest))
    d_plain = sum(not _equal(plain(small, *rest), first) for _ in range(reps - 1))
    print(f"| {name} | {reps} | {d_plain} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tokens", default="1,64,1500,2048")
    ap.add_argument("--experts", default="64,384")
    ap.add_argument("--interpret", action="store_true", help="CPU: the Mosaic GPU interpreter at small shapes")
    args = ap.parse_args()
    if not args.interpret and jax.default_backend() != "gpu":
        sys.exit("check_site_kernels_repeat.py runs the compiled kernels: it needs a CUDA GPU (or --interpret)")
    backend = "interpret" if args.interpret else "pallas"
    d = 256 if args.interpret else 5120
    print("| kernel | calls | calls differing from the first |")
    print("|---|---:|---:|")
    for t in map(int, args.tokens.split(",")):
        for e in map(int, args.experts.split(",")):
            cfg = dataclasses.replace(ModelConfig(), dim=d, n_routed_experts=e)
            k = jax.random.split(jax.random.key(t * 1000 + e), 3)
            x = jax.random.normal(k[0], (t, d)).astype(jnp.bfloat16)
            gate = {"weight": (jax.random.normal(k[1], (e, d)) * d ** -0.5).astype(jnp.bfloat16),
                    "bias": jax.random.normal(k[2], (e,)) * 0.1}
            small = {"bias": gate["bias"]}  # the weight (E x D bf16, >= 128 KB) stays out of the pack

            def route(s, x, wt, cfg=cfg):
                return R.route_fused(x, {"weight": wt, "bias": s["bias"]}, cfg, backend=backend)

            _count(f"router T={t} E={e}", route, small, (x, gate["weight"]), args.reps)
        y, h, post, comb, pre, fn, scale, base, w = make_inputs(jax.random.key(t), t, d)
        cfg = dataclasses.replace(ModelConfig(), dim=d)
        for first in (True, False):
            def site(s, y, h, post, comb, pre, fn, first=first):
                return M.mhc_fused(None if first else y, h, None if first else post, None if first else comb,
                                   pre, fn, s["scale"], s["base"], s["norm"], cfg, backend=backend)

            _count(f"mHC {'attention' if first else 'FFN'} site T={t}", site,
                   {"scale": scale, "base": base, "norm": w}, (y, h, post, comb, pre, fn), args.reps)


if __name__ == "__main__":
    main()
