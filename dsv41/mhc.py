"""mHC: the residual stream as hc_mult parallel copies, mixed by coefficients predicted from the stream.

Spec §2.2-2.3. Each sublayer site predicts (pre, post, comb) from its input stream; `post`/`comb` expand the
sublayer output back into the copies at once, while `pre` collapses the copies for the *next* sublayer (the
V4.1 delayed pre-mix).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41 import nn, quant
from dsv41.config import ModelConfig


def coefficients(x: jax.Array, fn: jax.Array, scale: jax.Array, base: jax.Array, cfg: ModelConfig):
    """x [B, S, hc, D] -> pre [B, S, hc], post [B, S, hc], comb [B, S, hc, hc] (comb[i, j]: source i -> j),
    all float32. One RMS statistic over the flattened hc*D values; comb made doubly stochastic by Sinkhorn.

    The 24 dot products are float32 products of x and fn. A bf16 stream is exact in bf16, so they run as
    `nn.linear_f32(fn, x)`: fn split into three exact bf16 terms, one tensor-core GEMM, every product exact (a
    float32 GEMM on a float32 copy of x ran on CUDA cores: the XLA path's mHC site took 204 us for 512 tokens
    on the H200)."""
    xf = x.reshape(*x.shape[:-2], -1).astype(jnp.float32)
    rs = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + cfg.norm_eps)
    if x.dtype == jnp.bfloat16:
        xb = x.reshape(-1, xf.shape[-1])
        m = nn.linear_f32(fn.astype(jnp.float32), xb).T.reshape(*xf.shape[:-1], fn.shape[0])  # [24, T] -> [..., 24]
    else:
        m = jnp.einsum("...k,mk->...m", xf, fn.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return coefficients_from_mix(m * rs, scale, base, cfg)


def coefficients_from_mix(m: jax.Array, scale: jax.Array, base: jax.Array, cfg: ModelConfig):
    """The mix values m [..., (2 + hc) * hc] (already times the RMS factor) -> pre, post, comb."""
    hc, eps = cfg.hc_mult, cfg.hc_eps
    scale, base = scale.astype(jnp.float32), base.astype(jnp.float32)
    pre = jax.nn.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * jax.nn.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(*m.shape[:-1], hc, hc)
    comb = jnp.exp(comb - jnp.max(comb, axis=-1, keepdims=True))
    comb = comb / jnp.sum(comb, axis=-1, keepdims=True) + eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)
    # the Sinkhorn iterations as straight-line code on a GPU, where XLA fuses them into a few kernels: as a while
    # loop they launched ~60 small ones a site on the H200 (the XLA site at one token 64 against 19 us, at 64
    # tokens 75 against 30, at 2048 458 against 451; docs/KERNELS_MHC.md, "Sinkhorn unrolled"). On the CPU, the
    # loop: unrolled, the tiny engine's decode program has 83k HLO instructions instead of 22k and compiles in
    # 14 s instead of 9, while a loop costs the CPU nothing. Same operations; results differ by float32 roundings.
    iters = cfg.hc_sinkhorn_iters - 1
    comb = jax.lax.platform_dependent(comb, cpu=lambda c: sinkhorn(c, iters, eps, unroll=False),
                                      default=lambda c: sinkhorn(c, iters, eps, unroll=True))
    return pre, post, comb


def sinkhorn(comb: jax.Array, iters: int, eps: float, unroll: bool) -> jax.Array:
    """`iters` row and column normalizations of comb [..., hc, hc], as a loop or as straight-line code."""
    def step(c, _):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps), None

    if unroll:
        for _ in range(iters):
            comb, _ = step(comb, None)
        return comb
    return jax.lax.scan(step, comb, None, length=iters)[0]


def collapse(x: jax.Array, pre: jax.Array) -> jax.Array:
    """[B, S, hc, D] x [B, S, hc] -> [B, S, D]: the sublayer input, summed in float32. Rounded with round_to:
    a bare astype would be dropped inside a GPU fusion with the norm that follows (excess precision)."""
    out = jnp.sum(pre[..., None] * x.astype(jnp.float32), axis=-2)
    return quant.round_to(out, x.dtype).astype(x.dtype)


def expand(y: jax.Array, residual: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """X'_j = post_j * y + sum_i comb[i, j] * X_i; y [B, S, D], residual [B, S, hc, D] -> [B, S, hc, D]."""
    mixed = jnp.einsum("...ij,...id->...jd", comb, residual.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    out = post[..., None] * y.astype(jnp.float32)[..., None, :] + mixed
    return quant.round_to(out, y.dtype).astype(y.dtype)  # rounded as stored, also where the use fuses


def site(y: jax.Array | None, h: jax.Array, post, comb, pre: jax.Array, fn: jax.Array, scale: jax.Array,
         base: jax.Array, norm_w: jax.Array, cfg: ModelConfig):
    """One mHC site (the plain composition of `Ops.mhc_site`): y [..., D] (the previous sublayer's output, None
    at a block's first site) expanded into h [..., hc, D] through post [..., hc] / comb [..., hc, hc]; the new
    stream's coefficients; its copies collapsed through the previous site's pre [..., hc] and normalized.
    -> (h' [..., hc, D], x [..., D] (the sublayer input), pre', post', comb')."""
    if y is not None:
        h = expand(y, h, post, comb)
    pre1, post1, comb1 = coefficients(h, fn, scale, base, cfg)
    x = nn.rms_norm(collapse(h, pre), norm_w, cfg.norm_eps)
    return h, x, pre1, post1, comb1
