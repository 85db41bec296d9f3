"""Primitives every module uses: RMSNorm and the linear layer with the reference's rounding points."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dsv41 import quant
from dsv41.quant import Numerics
from pallas_kernels import fp8_linear


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
    rows = math.prod(x.shape[:-1])
    if isinstance(w, fp8_linear.PreparedFp8) and rows <= fp8_linear.MAX_ROWS and dt == jnp.bfloat16:
        # decode-sized batches: the FP8 weight is read once, decoded in the kernel (prepare_linears)
        return fp8_linear.fp8_linear(x.reshape(rows, x.shape[-1]), w).reshape(*x.shape[:-1], -1)
    wd = quant.dense(w, dt)
    return jnp.einsum("...i,oi->...o", x, wd, preferred_element_type=jnp.float32).astype(dt)


def grouped_linear(x: jax.Array, w, num: Numerics) -> jax.Array:
    """x [..., G, in] -> [..., G, out]: group g's inputs times its own weight block (wo_a). w: [G * out, in]
    (dense or Fp8Weight), or `fp8_linear.PreparedFp8` [G, out, in] (`prepare_linears`), which decode-sized
    inputs run through the FP8 kernel as G groups of one grouped GEMM. bf16 products, float32 accumulation,
    no activation quantization (the reference's wo_a einsum)."""
    dt = num.jdtype
    x = x.astype(dt)
    g, rows = x.shape[-2], math.prod(x.shape[:-2])
    if isinstance(w, fp8_linear.PreparedFp8) and rows <= fp8_linear.MAX_ROWS and dt == jnp.bfloat16:
        y = fp8_linear.fp8_grouped_linear(jnp.swapaxes(x.reshape(rows, g, -1), 0, 1), w)  # [G, rows, out]
        return jnp.swapaxes(y, 0, 1).reshape(*x.shape[:-1], -1)
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


# The FP8 linears that run through `linear`, by path in a layer (wo_a: `grouped_linear`, GROUPED_FP8_LINEARS).
FP8_LINEARS = (("attn", "wq_a"), ("attn", "wq_b"), ("attn", "wkv"), ("attn", "wo_b"), ("attn", "indexer", "wq_b"),
               ("ffn", "shared_experts", "w1"), ("ffn", "shared_experts", "w2"), ("ffn", "shared_experts", "w3"),
               ("engram", "wkv"))


# Grouped linears stored dense in our tree but FP8 in the release (convert.py dequantizes wo_a): their values
# are FP8 values, so `prepare_linears` takes them back to FP8 exactly (and leaves them dense if they are not).
GROUPED_FP8_LINEARS = (("attn", "wo_a"),)


def _grouped_fp8(w, groups: int, interpret: bool):
    """A dense [G * out, in] weight holding FP8 values -> PreparedFp8 [G, out, in], or None where its values are
    not exactly FP8 with 32x32 block scales (then it stays dense)."""
    if quant.is_quantized(w) or w.ndim != 2 or w.shape[0] % groups:
        return None
    q = quant.quantize_fp8_weight(w.reshape(groups, -1, w.shape[-1]))
    if not fp8_linear.supported(q):
        return None
    if not isinstance(w, jax.core.Tracer):  # abstract trees (eval_shape) take the kernel layout as given
        if not bool(jnp.array_equal(q.dequantize(w.dtype).reshape(w.shape), w)):
            return None
    return fp8_linear.prepare_fp8_linear(q, interpret=interpret)


def prepare_linears(params: dict, cfg, interpret: bool = False) -> dict:
    """The FP8 linears (`FP8_LINEARS`, and `GROUPED_FP8_LINEARS` in `cfg.o_groups` groups) in the FP8 linear
    kernel's layout (once, at load): `linear` / `grouped_linear` then read each weight byte once at decode
    instead of XLA writing a bf16 copy first. Weights the kernel cannot take (not FP8, dims not multiples of
    128) stay as they are. Returns a new tree; the old weights are dropped layer by layer."""
    def convert(tree: dict, path: tuple[str, ...], grouped: bool) -> dict:
        head, *rest = path
        if head not in tree:
            return tree
        if rest:
            return {**tree, head: convert(tree[head], tuple(rest), grouped)}
        w = tree[head]
        if grouped:
            pw = _grouped_fp8(w, cfg.o_groups, interpret)
            return tree if pw is None else {**tree, head: pw}
        if not fp8_linear.supported(w):
            return tree
        return {**tree, head: fp8_linear.prepare_fp8_linear(w, interpret=interpret)}

    layers = []
    for lp in params["layers"]:
        for path in FP8_LINEARS:
            lp = convert(lp, path, False)
        for path in GROUPED_FP8_LINEARS:
            lp = convert(lp, path, True)
        layers.append(lp)
    return {**params, "layers": layers}
