"""The bench preset's blocks (a stand-in attention) with the fused mHC and router sites, the parameters as they are
against packed (serving/engine/packed_params.py, what `Engine(pack_params=True)` hands a program): per layer, how
far the stream and the FFN pre-mix move and how many tokens' routing changed, for each site backend.

Packing only slices the same values out of a buffer, but XLA fuses the slices into their readers, so the ops
around a kernel (the mHC site's float32 epilogue) may sum in another order: rounding-level differences, which flip
near-tie routing choices, and a flipped token's stream then differs by whole expert outputs. The stand-in
attention mixes no tokens, so the tokens whose routing never changed compare rounding against rounding: that is
the column a wrong operand read (every token off) would fail. On the H200 (seventeenth session) the engine with
the fused sites moved its first logits by 0.238 when packed; this split it to the mHC kernel's calls at 2048
tokens: one token's experts differed at layer 0, 51 tokens' at layer 7 (the other site backends at 2048 tokens:
exactly equal; at 128 tokens no token rerouted and every layer within 0.0066).

    PYTHONPATH=. python3 scripts/check_packed_sites.py --tokens 2048,128
    .venv/bin/python scripts/check_packed_sites.py --interpret --tokens 16   # CPU: the script's logic
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsv41 import model, quant  # noqa: E402
from dsv41 import params as P  # noqa: E402
from dsv41.config import preset  # noqa: E402
from serving.engine import packed_params  # noqa: E402

NUM = quant.Numerics(act_quant=False, bf16_probs=True, dtype="bfloat16")


@functools.partial(jax.jit, static_argnames=("cfg", "sites"))
def stack(params, h, pre, cfg, sites):
    """Every layer's block in turn (attention: a stand-in that halves its input, no token mixing) -> per layer
    (stream [1, T, hc, D], FFN pre-mix [1, T, hc], routed expert ids [..., k])."""
    params = packed_params.unpack(params)
    attn = lambda x: (x.astype(jnp.float32) * 0.5).astype(x.dtype)  # noqa: E731
    outs = []
    for i, lp in enumerate(params["layers"]):
        trace = {}
        h, pre = model.block(h, pre, lp, i, cfg, NUM, attn, trace=trace, sites=sites)
        outs.append((h, pre, trace[f"layer{i}.moe.experts"]))
    return outs


def block_params(params: dict) -> dict:
    """The parameters `stack` reads: the tree without the Engram layers' parts (blocks do not run them)."""
    return {**params, "layers": [{k: v for k, v in lp.items() if k != "engram"} for lp in params["layers"]]}


def compare(params, packed, tokens: int, cfg, sites) -> list[dict]:
    """The block stack on random streams of `tokens` tokens from `params` and from `packed` -> per layer: stream
    rel. max difference over all tokens and over the tokens whose routing never changed ('kept'), the pre-mix's
    max difference over the kept tokens, and how many tokens have been rerouted so far."""
    k = jax.random.split(jax.random.key(tokens), 2)
    h = (jax.random.normal(k[0], (1, tokens, cfg.hc_mult, cfg.dim)) * 2).astype(jnp.bfloat16)
    pre = jax.nn.softmax(jax.random.normal(k[1], (1, tokens, cfg.hc_mult)), -1)
    rows, kept = [], np.ones(tokens, bool)
    for (ha, pa, ia), (hb, pb, ib) in zip(stack(params, h, pre, cfg, sites), stack(packed, h, pre, cfg, sites)):
        ha, hb = np.asarray(ha, np.float32)[0], np.asarray(hb, np.float32)[0]
        ia, ib = (np.sort(np.asarray(i).reshape(tokens, -1), -1) for i in (ia, ib))
        kept &= (ia == ib).all(-1)
        d = np.abs(ha - hb).max(axis=(1, 2))
        rows.append({"rel": float(d.max() / np.abs(ha).max()),
                     "rel_kept": float(d[kept].max(initial=0) / np.abs(ha[kept]).max(initial=1e-30)),
                     "pre_kept": float(np.abs(np.asarray(pa) - np.asarray(pb))[0][kept].max(initial=0)),
                     "rerouted": int((~kept).sum())})
    return rows


def within_rounding(rows: list[dict], tokens: int, stream_tol: float = 2e-2, pre_tol: float = 5e-3) -> bool:
    """`compare`'s rows say packing changed roundings only: on the tokens never rerouted, the stream within
    stream_tol (relative) and the pre-mix within pre_tol at every layer, and under a tenth of the tokens rerouted
    by the last layer. A misread operand moves every token, so it fails one of these."""
    return (all(r["rel_kept"] < stream_tol and r["pre_kept"] < pre_tol for r in rows)
            and rows[-1]["rerouted"] < tokens // 10)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="2048,128")
    ap.add_argument("--sites", default="xla,mhc,router,both")
    ap.add_argument("--interpret", action="store_true",
                    help="CPU: the tiny preset (64 experts: the router kernel's tile) through the interpreter")
    args = ap.parse_args()
    if not args.interpret and jax.default_backend() != "gpu":
        sys.exit("check_packed_sites.py runs the compiled kernels: it needs a CUDA GPU (or --interpret)")
    cfg = dataclasses.replace(preset("tiny"), n_routed_experts=64) if args.interpret else preset("bench")
    core = block_params(P.init_params(cfg, seed=0))
    packed = packed_params.pack(core)
    print(f"{len(jax.tree.leaves(core))} parameter arrays -> {packed.num_arrays} packed")
    kernel = "interpret" if args.interpret else "pallas"
    cases = {"xla": model.Sites(), "mhc": model.Sites(mhc=kernel), "router": model.Sites(router=kernel),
             "both": model.Sites(mhc=kernel, router=kernel)}
    print("| tokens | sites | layer | stream rel. max diff | on tokens never rerouted | their pre-mix max diff "
          "| tokens rerouted so far |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for t in map(int, args.tokens.split(",")):
        for name in args.sites.split(","):
            for i, r in enumerate(compare(core, packed, t, cfg, cases[name])):
                print(f"| {t} | {name} | {i} | {r['rel']:.3g} | {r['rel_kept']:.3g} | {r['pre_kept']:.3g} "
                      f"| {r['rerouted']} |", flush=True)


if __name__ == "__main__":
    main()
