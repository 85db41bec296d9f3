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


def gather_rows(table: quant.Fp8Rows, row_ids) -> np.ndarray | jax.Array:
    """Row ids [...] -> dequantized rows [..., d] in bf16, as the reference rounds them before `wkv`.

    A host table (numpy / memory-mapped) is read on the host so only the needed rows travel to the device.
    """
    if isinstance(table.weight, np.ndarray):
        ids = np.asarray(row_ids)
        w = np.asarray(table.weight[ids.reshape(-1)]).reshape(*ids.shape, -1)
        s = np.asarray(table.scale[ids.reshape(-1)]).reshape(*ids.shape, -1)
        rows = w.astype(np.float32).reshape(*w.shape[:-1], -1, 32)
        scale = (s.astype(np.uint32) << 23).view(np.float32)[..., None]
        return (rows * scale).reshape(w.shape).astype(jnp.bfloat16)
    ids = jnp.asarray(row_ids)
    return quant.fp8_dequantize(table.weight[ids], quant.ue8m0_decode(table.scale[ids])).astype(jnp.bfloat16)


def engram(x: jax.Array, rows: jax.Array, p: dict, cfg: ModelConfig, num: Numerics,
           token_mask: jax.Array | None = None) -> jax.Array:
    """x [B, S, hc, D], rows [B, S, n_cols, d] -> x + gate * value, gate [B, S, hc] per stream.

    token_mask [B, S]: False shuts the gate (image-span tokens).
    """
    hc, D = cfg.hc_mult, cfg.dim
    kv = linear(rows.reshape(*rows.shape[:-2], -1), p["wkv"], num, fp8_input=True)
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
