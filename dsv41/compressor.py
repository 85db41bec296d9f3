"""CSA2 compressor (spec §2.4): pools `ratio` consecutive tokens into one 512-wide latent.

ratio 2: softmax over the 2 tokens (per channel) of a gated projection, in float32; ratio 1: a plain
projection. No overlap between groups and no positional bias (unlike V4). Latents come out pre-RoPE:
the indexer keys are taken from them before attention rotates and quantizes them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41 import quant
from dsv41.config import ModelConfig
from dsv41.nn import linear, linear_f32, rms_norm
from dsv41.quant import Numerics


def project(x: jax.Array, p: dict, ratio: int, num: Numerics):
    """x [..., D] -> (kv, score) [..., head_dim] float32 for ratio 2; (kv, None) in the activation dtype for 1."""
    if ratio == 1:
        return linear(x, p["wkv"], num, fp8_input=False), None
    return linear_f32(x, p["wkv"]), linear_f32(x, p["wgate"])


def pool_groups(kv: jax.Array, score: jax.Array, p: dict, cfg: ModelConfig, dtype) -> jax.Array:
    """kv/score [..., ratio, Dh] float32 -> latent [..., Dh]: per-channel softmax over the group's tokens."""
    w = jax.nn.softmax(score, axis=-2)
    latent = jnp.sum(kv * w, axis=-2)
    # the pooled latent is rounded to the activation dtype before the norm, as the reference does
    return rms_norm(quant.round_to(latent, dtype).astype(dtype), p["norm"], cfg.norm_eps)


def compress(x: jax.Array, p: dict, ratio: int, cfg: ModelConfig, num: Numerics) -> jax.Array:
    """x [B, S, D] -> latents of the complete groups [B, S // ratio, Dh]; a trailing partial group is dropped
    here (the engine keeps it as pending state)."""
    B, S, _ = x.shape
    G = S // ratio
    kv, score = project(x, p, ratio, num)
    if ratio == 1:
        return rms_norm(kv, p["norm"], cfg.norm_eps)
    kv = kv[:, : G * ratio].reshape(B, G, ratio, -1)
    score = score[:, : G * ratio].reshape(B, G, ratio, -1)
    return pool_groups(kv, score, p, cfg, num.jdtype)
