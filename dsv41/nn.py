"""Primitives every module uses: RMSNorm and the linear layer with the reference's rounding points."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41 import quant
from dsv41.quant import Numerics


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
    """y = w * x / sqrt(mean(x^2) + eps), computed in float32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if w is not None:
        y = w.astype(jnp.float32) * y
    return y.astype(x.dtype)


def linear(x: jax.Array, w, num: Numerics, *, fp8_input: bool) -> jax.Array:
    """x [..., in] @ w[out, in]^T -> [..., out] in the activation dtype, accumulated in float32.

    fp8_input: the release stores this weight in FP8/FP4, so the reference quantizes the activation to
    FP8 per 32 before the GEMM (applied when `num.act_quant`). The weight may be dense or quantized; a
    quantized one dequantizes exactly into bf16 (e4m3 and e2m1 times a power of two fit its mantissa).
    """
    dt = num.jdtype
    x = x.astype(dt)
    if fp8_input and num.act_quant:
        x = quant.fp8_qdq(x)
    wd = quant.dense(w, dt)
    return jnp.einsum("...i,oi->...o", x, wd, preferred_element_type=jnp.float32).astype(dt)


def linear_f32(x: jax.Array, w) -> jax.Array:
    """A float32 GEMM on float32 inputs (router, compressor pooling, head)."""
    return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), quant.dense(w, jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
