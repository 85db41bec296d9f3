"""Engram: n-gram memory rows, gated into all hc streams (spec §2.6). Hashing is host-side (ngram_hash.py);
this module turns the fetched rows into the gated update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import quant
from dsv41.config import ModelConfig
from dsv41.nn import linear
from dsv41.quant import Numerics


def gather_rows(table: quant.Fp8Rows, row_ids) -> quant.Fp8Rows:
    """Row ids [...] -> those rows as stored: e4m3 [..., d] and UE8M0 scales uint8 [..., d/32].

    A host table (numpy / memory-mapped) is read on the host and its rows stay FP8: half the bytes of bf16 rows
    travel to the device, and the dequantization (`dequantize_rows`) runs there, inside the jitted program
    (on the host it was most of a decode step's host time at batch 64, docs/PERFORMANCE.md).
    """
    if isinstance(table.weight, np.ndarray):
        ids = np.asarray(row_ids)
        flat = ids.reshape(-1)
        # gathered as bytes: numpy copies ml_dtypes' float8 element by element, 3x slower
        w = np.take(table.weight.view(np.uint8), flat, axis=0).view(table.weight.dtype)
        return quant.Fp8Rows(w.reshape(*ids.shape, -1), np.take(table.scale, flat, axis=0).reshape(*ids.shape, -1))
    ids = jnp.asarray(row_ids)
    return quant.Fp8Rows(table.weight[ids], table.scale[ids])


def dequantize_rows(rows: quant.Fp8Rows) -> jax.Array:
    """Gathered rows -> bf16 [..., d], as the reference rounds them before `wkv`."""
    return quant.fp8_dequantize(rows.weight, quant.ue8m0_decode(rows.scale)).astype(jnp.bfloat16)


def engram(x: jax.Array, rows: quant.Fp8Rows, p: dict, cfg: ModelConfig, num: Numerics,
           token_mask: jax.Array | None = None, ops=None) -> jax.Array:
    """x [B, S, hc, D], rows [B, S, n_cols, d] (`gather_rows`) -> x + gate * value, gate [B, S, hc] per stream.

    token_mask [B, S]: False shuts the gate (image-span tokens). ops: the `dsv41.ops.Ops` whose linears run here
    (None: `nn`'s XLA ones).
    """
    hc, D = cfg.hc_mult, cfg.dim
    r = dequantize_rows(rows)
    kv = (linear if ops is None else ops.linear)(r.reshape(*r.shape[:-2], -1), p["wkv"], num, fp8_input=True)
    key = kv[..., : hc * D].astype(jnp.float32).reshape(*kv.shape[:-1], hc, D)
    value = kv[..., hc * D:].astype(jnp.float32)
    weight = p["q_weight"].astype(jnp.float32) * p["k_weight"].astype(jnp.float32)
    h = x.astype(jnp.float32)
    eps = cfg.norm_eps
    # normalized per (token, stream) over D, not jointly over the streams
    rstd = jax.lax.rsqrt(jnp.mean(h * h, -1) + eps) * jax.lax.rsqrt(jnp.mean(key * key, -1) + eps)
    dot = jnp.sum(h * weight * key, -1) * rstd * D**-0.5
    gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)), dot))
    if token_mask is not None:
        gate = jnp.where(token_mask[..., None], gate, 0.0)
    return (h + gate[..., None] * value[..., None, :]).astype(x.dtype)
