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


def linear_input(x: jax.Array, num: Numerics, fp8_input: bool) -> jax.Array:
    """x in the activation dtype, FP8-rounded per 32 where the reference quantizes it (`linear`'s input, which a
    kernel linear must see too)."""
    x = x.astype(num.jdtype)
    return quant.fp8_qdq(x) if fp8_input and num.act_quant else x


def linear(x: jax.Array, w, num: Numerics, *, fp8_input: bool) -> jax.Array:
    """x [..., in] @ w[out, in]^T -> [..., out] in the activation dtype, accumulated in float32.

    fp8_input: the release stores this weight in FP8/FP4, so the reference quantizes the activation to
    FP8 per 32 before the GEMM (applied when `num.act_quant`). The weight may be dense or quantized; a
    quantized one dequantizes exactly into bf16 (e4m3 and e2m1 times a power of two fit its mantissa).
    """
    dt = num.jdtype
    x = linear_input(x, num, fp8_input)
    wd = quant.dense(w, dt)
    return jnp.einsum("...i,oi->...o", x, wd, preferred_element_type=jnp.float32).astype(dt)


def grouped_linear(x: jax.Array, w, num: Numerics) -> jax.Array:
    """x [..., G, in] -> [..., G, out]: group g's inputs times its own weight block (wo_a). w: [G * out, in]
    (dense, Fp8Weight, or any weight `quant.dense` takes in [G, out, in] order). bf16 products, float32
    accumulation, no activation quantization (the reference's wo_a einsum)."""
    dt = num.jdtype
    x = x.astype(dt)
    g = x.shape[-2]
    wd = quant.dense(w, dt).reshape(g, -1, x.shape[-1])
    return jnp.einsum("...gd,grd->...gr", x, wd, preferred_element_type=jnp.float32).astype(dt)


def linear_f32(x: jax.Array, w) -> jax.Array:
    """x [..., in] @ w[out, in]^T in float32 on float32 inputs (router, compressor pooling, head).

    These weights are exact in bf16 (stored bf16, or FP8/FP4, which dequantize exactly into bf16), so x is split
    exactly into three bf16 terms (hi + mid + lo: 3 x 8 significant bits = float32's 24) and the product is
    three bf16 GEMMs with float32 accumulation, stacked into one so the weight is read once: every product is
    exact, only the summation order differs from a float32 GEMM. XLA's float32 GEMM copied the weight to
    float32 and ran without tensor cores (the head alone: 2.7 ms of a 15.8 ms batch-64 decode step on the
    H200). Other weights take the float32 GEMM.

    The split rounds with `quant.round_to`, not an astype(bf16).astype(f32) pair: XLA's GPU compiler removes such
    pairs (SimplifyFPConversions, on by default with excess precision allowed), which made the remainders zero
    and the product a plain bf16 one on the H200 (the fused mHC site's pre-mix then differed from this path's
    by 8.6e-4, against 2.8e-5 before the mix dots moved here; tests/test_gpu_conversions.py)."""
    x = x.astype(jnp.float32)
    if not (quant.is_quantized(w) or w.dtype == jnp.bfloat16):
        return jnp.einsum("...i,oi->...o", x, quant.dense(w, jnp.float32), precision=jax.lax.Precision.HIGHEST)
    hi = quant.round_to(x, jnp.bfloat16)
    r = x - hi
    mid = quant.round_to(r, jnp.bfloat16)
    terms = [t.astype(jnp.bfloat16) for t in (hi, mid, r - mid)]  # each exact in bf16
    y = jnp.einsum("t...i,oi->t...o", jnp.stack(terms), quant.dense(w, jnp.bfloat16),
                   preferred_element_type=jnp.float32)
    return y[0] + (y[1] + y[2])
