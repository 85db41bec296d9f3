"""The packed-parameter check of the fused site kernels (tests/test_packed_params.py, tests/test_engine_gpu.py):
the blocks with a stand-in attention, the parameters as they are against packed, per layer."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import model, quant
from serving.engine import packed_params

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


