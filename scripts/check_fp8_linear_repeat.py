"""Calls the FP8 linear kernel many times on the same inputs and counts calls whose result is not bit-identical
to the first (a race in the chained pipeline would show as rare differing calls), at Flash's linear shapes and as
the grouped wo_a (8 groups of [1024, 4096], `nn.grouped_linear`).

    PYTHONPATH=. python3 scripts/check_fp8_linear_repeat.py --reps 200
"""

import argparse
import logging
import sys

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import nn, quant
from pallas_kernels import fp8_linear as f8
from bench_fp8_linear import SHAPES, random_fp8  # scripts/, on the path when run as a script

GROUPS = 8  # Flash's o_groups: wo_a [8 * 1024, 4096]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rows", default="1,8,64,128")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if jax.default_backend() != "gpu":
        sys.exit("check_fp8_linear_repeat.py runs the compiled kernel: it needs a CUDA GPU")
    num = quant.Numerics(act_quant=False, dtype="bfloat16")
    run = jax.jit(lambda x, w: nn.linear(x, w, num, fp8_input=True))
    print("| linear | rows | calls | calls differing from the first | max rel. difference vs XLA |")
    print("|---|---|---|---|---|")
    grouped = jax.jit(lambda x, w: nn.grouped_linear(x, w, num))
    cases = [(name, n, k, run, None) for name, (n, k) in SHAPES.items()]
    cases.append(("attn.wo_a (grouped)", GROUPS * 1024, 4096, grouped, GROUPS))
    for i, (name, n, k, fn, g) in enumerate(cases):
        w = random_fp8(jax.random.key(i), n, k)
        # the grouped kernel reads [G, out, in]; XLA's einsum the same weight as [G * out, in]
        pw = f8.prepare_fp8_linear(w if g is None else quant.Fp8Weight(w.weight.reshape(g, n // g, k),
                                                                       w.scale.reshape(g, -1, k // 32)))
        for rows in map(int, args.rows.split(",")):
            shape = (rows, k) if g is None else (rows, g, k)
            x = jax.random.normal(jax.random.key(100 + rows), shape).astype(jnp.bfloat16)
            ref = np.asarray(fn(x, w).astype(jnp.float32))
            outs = [fn(x, pw) for _ in range(args.reps)]
            first = np.asarray(outs[0].astype(jnp.float32))
            differ = sum(not np.array_equal(np.asarray(o.astype(jnp.float32)), first) for o in outs[1:])
            rel = max(float(np.abs(np.asarray(o.astype(jnp.float32)) - ref).max() / np.abs(ref).max())
                      for o in outs[:: max(1, args.reps // 20)])
            print(f"| {name} | {rows} | {args.reps} | {differ} | {rel:.3g} |", flush=True)


if __name__ == "__main__":
    main()
