"""Partial rotary embedding on the last `rope_head_dim` dims, adjacent pairs (GPT-J interleaved), with YaRN on
compressed layers. Spec §2.4: ratio 0 -> theta=rope_theta, no YaRN; ratio > 0 -> compress_rope_theta + YaRN."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dsv41.config import ModelConfig


def inv_freq(cfg: ModelConfig, layer: int) -> np.ndarray:
    """Rotation frequencies [rope_head_dim/2] (float32) of `layer` (n_layers.. : the window-only DSpark stages)."""
    dim = cfg.rope_head_dim
    compressed = layer < cfg.n_layers and cfg.compress_ratios[layer] > 0
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    orig = cfg.original_seq_len if compressed else 0
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    freqs = freqs.astype(np.float32)
    if orig > 0:
        def corrected_dim(rotations: float) -> float:
            return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(cfg.beta_fast)), 0)
        high = min(math.ceil(corrected_dim(cfg.beta_slow)), dim - 1)
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / max(high - low, 1e-3), 0, 1)
        freqs = (freqs / np.float32(cfg.rope_factor) * ramp + freqs * (1 - ramp)).astype(np.float32)
    return freqs


def cos_sin(pos: jax.Array, freqs: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """Integer positions [...] -> float32 cos, sin [..., len(freqs)] of the rotation angles (what `apply_rope`
    rotates by, and what a kernel that rotates in place is handed)."""
    angle = pos.astype(jnp.float32)[..., None] * jnp.asarray(freqs)
    return jnp.cos(angle), jnp.sin(angle)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, inverse: bool = False) -> jax.Array:
    """Rotate the last R = 2*cos.shape[-1] dims of x [..., d] as adjacent pairs (x_2i, x_2i+1) by the angles whose
    cos, sin [..., R/2] are given (broadcast against x's leading dims). Float32 math, result in x's dtype. What
    `apply_rope` does once the angles are known, and what a kernel's caller that was handed cos/sin calls."""
    rd = 2 * cos.shape[-1]
    cos, sin = cos.astype(jnp.float32), sin.astype(jnp.float32)
    if inverse:
        sin = -sin
    head = x[..., :-rd]
    r = x[..., -rd:].astype(jnp.float32).reshape(*x.shape[:-1], rd // 2, 2)
    a, b = r[..., 0], r[..., 1]
    rot = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(*x.shape[:-1], rd)
    return jnp.concatenate([head, rot.astype(x.dtype)], axis=-1)


def apply_rope(x: jax.Array, pos: jax.Array, freqs: np.ndarray, inverse: bool = False) -> jax.Array:
    """Rotate the last 2*len(freqs) dims of x [..., d] at integer positions `pos` (broadcast against x's
    leading dims: [B, S] for x [B, S, d] or [B, S, H, d] -- pass pos[..., None] for the head axis).
    Float32 math, result in x's dtype."""
    cos, sin = cos_sin(pos, freqs)  # [..., rd/2]
    return rotate(x, cos, sin, inverse)
