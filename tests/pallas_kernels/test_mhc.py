"""Fused mHC site: the Mosaic GPU kernel in the Mosaic GPU interpreter (CPU) against the plain-jnp reference
(the dsv41.mhc composition), the XLA epilogue at Flash shapes, and the lowering for sm_90a at Flash shapes.
GPU-only tests run the compiled kernel (marked `gpu`).

Tolerances: h1 and x are bf16 outputs of f32 sums whose order differs from XLA's, so an element may round to
the neighbouring bf16 value on rare ties: h1 by one ulp, x by up to two (a tie flip in the bf16 collapse xc,
then the normalization's own rounding; measured on the H200: 3-5 of 2.6M elements at T=512); the f32 coefficients differ only by the
summation order of the hc*D-long dot products (abs 2e-5; measured ~5e-7 in the interpreter), checked against
the reference applied to the kernel's own h1 (see _check_kernel)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41.config import ModelConfig
from pallas_kernels import mhc as M
from serving.engine import backends as BK

CFG = ModelConfig()
NAMES = ("h1", "x", "pre", "post", "comb")


def _data(key, lead, d, hc=4):
    """Random inputs, eagerly (the GPU tests) or as one program (`_data_jit`, the CPU tests: eagerly ~30 compiles
    of ~40 ms). The barriers keep each draw apart from the arithmetic on it, as eagerly, where XLA would fold e.g.
    the normal's own scaling into `* 0.05`: jitted, the same bits as eagerly at the CPU tests' shapes."""
    k = jax.random.split(key, 9)
    draw = jax.lax.optimization_barrier
    y = draw(jax.random.normal(k[0], (*lead, d))).astype(jnp.bfloat16)
    h = (draw(jax.random.normal(k[1], (*lead, hc, d))) * 3).astype(jnp.bfloat16)
    post = 2 * jax.nn.sigmoid(draw(jax.random.normal(k[2], (*lead, hc))))
    comb = jax.nn.softmax(draw(jax.random.normal(k[3], (*lead, hc, hc))), -1)
    pre = jax.nn.sigmoid(draw(jax.random.normal(k[4], (*lead, hc)))) + 1e-6
    fn = draw(jax.random.normal(k[5], (24, hc * d))) * 0.05
    scale = draw(jax.random.uniform(k[6], (3,), minval=0.5, maxval=2.0))
    base = draw(jax.random.normal(k[7], (24,)))
    w = (1 + 0.1 * draw(jax.random.normal(k[8], (d,)))).astype(jnp.bfloat16)
    return [y, h, post, comb, pre, fn, scale, base, w]


_data_jit = jax.jit(_data, static_argnums=(1, 2, 3))


def _check(out, ref, frac=0.01):
    for name, o, r in zip(NAMES, out, ref):
        assert o.shape == r.shape and o.dtype == r.dtype, (name, o.shape, r.shape, o.dtype, r.dtype)
        o = np.asarray(o, np.float32)  # on the host: eagerly, an astype is a compile for each shape
        r = np.asarray(r, np.float32)
        assert np.all(np.isfinite(o)), f"{name}: non-finite (unwritten) elements"
        if name in ("h1", "x"):
            np.testing.assert_allclose(o, r, rtol=2 ** -6, atol=1e-6, err_msg=name)
            assert np.mean(o != r) <= frac, (name, np.mean(o != r))
        else:
            np.testing.assert_allclose(o, r, rtol=0, atol=2e-5, err_msg=name)


def _check_kernel(out, a):
    """h1 against the reference; x and the coefficients against the reference applied to the kernel's own h1
    (a one-ulp tie flip in a bf16 h1 element moves the 24 mix values by up to |fn| * ulp, which would say
    nothing about the kernel's statistics)."""
    ref = _xla(*a)
    _check(out[:1], ref[:1])
    _check(out, _xla(None, out[0], None, None, *a[4:]))


@pytest.mark.parametrize("lead,d,tt,first,seed", [
    ((2,), 256, 2, False, 0),  # 2 D chunks (cross-CTA sums), 2 tokens in one CTA (the token loop reuses smem)
    ((3, 1), 128, 8, True, 1),  # first site (no expand), batch dims flattened; tt=3: a token pair + a lone token
])
def test_kernel_interpret_matches_reference(lead, d, tt, first, seed):
    a = _data_jit(jax.random.key(seed), lead, d)
    if first:
        a[0] = a[2] = a[3] = None
    out = jax.jit(lambda *b: M.mhc_fused(*b, CFG, backend="interpret", config=M.KernelConfig(tt=tt)))(*a)
    jax.block_until_ready(out)  # the interpreter is not re-entrant: block before the next call
    _check_kernel(out, a)


_xla = jax.jit(lambda *b: M.mhc_fused(*b, CFG, backend="xla"))


def test_first_site_passes_h_through():
    a = _data_jit(jax.random.key(2), (4,), 256)
    h1, *_ = _xla(None, a[1], None, None, *a[4:])
    np.testing.assert_array_equal(h1, a[1])
    with pytest.raises(ValueError):
        M.mhc_fused(a[0], a[1], None, a[3], *a[4:], CFG, backend="pallas")


def test_epilogue_matches_reference_at_flash_shapes():
    """Phase 2 (XLA) fed with exact partial sums at D=5120: the unrolled Sinkhorn and the stats algebra."""
    t, hc, d, n_chunks = 3, 4, CFG.dim, 40
    a = _data_jit(jax.random.key(3), (t,), d)
    jax.jit(functools.partial(_epilogue_case, t=t, hc=hc, d=d, n_chunks=n_chunks))(*a)


def _epilogue_case(y, h, post, comb, pre, fn, scale, base, w, t, hc, d, n_chunks):
    h1 = M.mhc.expand(y, h, post, comb)
    xc = M.mhc.collapse(h1, pre)
    f = h1.astype(jnp.float32).reshape(t, hc, n_chunks, d // n_chunks)
    fnr = fn.reshape(24, hc, n_chunks, d // n_chunks)
    dots = jnp.einsum("tick,mick->ctm", f, fnr, precision=jax.lax.Precision.HIGHEST)
    sq = jnp.sum(f * f, axis=(1, 3)).T[..., None]
    xq = xc.astype(jnp.float32).reshape(t, n_chunks, -1)
    sqx = jnp.sum(xq * xq, axis=-1).T[..., None]
    part = jnp.concatenate([dots, sq, sqx, jnp.zeros((n_chunks, t, M.TOKEN_ROWS - 26))], -1)
    x, p2, q2, c2 = M._finish(part, xc, scale, base, w, CFG)
    ref = M.mhc_reference(y, h, post, comb, pre, fn, scale, base, w, CFG)
    jax.debug.callback(_check, (h1, x, p2, q2, c2), ref)


def test_block_with_fused_sites_matches_xla():
    """dsv41.model.block with both mHC sites through the kernel (interpreter) against the XLA composition, on the
    tiny preset's first layer (D=256, real FP8/FP4 weights, bf16): the stream out and the FFN's pre-mix. The
    sublayers see the kernel's x, whose rare one-ulp ties move a few MoE outputs by their own rounding."""
    from dsv41 import model, quant
    from dsv41 import params as P
    from dsv41.config import preset

    cfg = preset("tiny")
    lp = P.init_tree(P.layer_specs(cfg, 0), cfg, seed=0)
    num = quant.Numerics(act_quant=False)

    @jax.jit  # one program, the same bits as eagerly (see _data)
    def inputs(key):
        k = jax.random.split(key, 2)
        h = jax.lax.optimization_barrier(jax.random.normal(k[0], (1, 5, cfg.hc_mult, cfg.dim))) * 2
        pre = jax.nn.softmax(jax.lax.optimization_barrier(jax.random.normal(k[1], (1, 5, cfg.hc_mult))), -1)
        return h.astype(jnp.bfloat16), pre

    h, pre = inputs(jax.random.key(7))
    attn = lambda x, s: ((x.astype(jnp.float32) * 0.5).astype(x.dtype), s)  # noqa: E731
    outs = {}
    for be in ("xla", "interpret"):
        ops = BK.kernel_ops(mhc=be)
        outs[be] = jax.jit(lambda h, pre, lp, ops=ops: model.block(h, pre, lp, 0, cfg, num, attn, ops=ops)[:2])(
            h, pre, lp)
        jax.block_until_ready(outs[be])  # the interpreter is not re-entrant
    (hx, px), (hk, pk) = outs["xla"], outs["interpret"]
    hx, hk = np.asarray(hx, np.float32), np.asarray(hk, np.float32)
    np.testing.assert_allclose(hk, hx, rtol=2 ** -6, atol=2e-2 * np.abs(hx).max())
    assert np.mean(hk != hx) < 0.02
    np.testing.assert_allclose(np.asarray(pk), np.asarray(px), atol=1e-4)


@pytest.mark.parametrize("tokens, kernels", [(4, True), (5, False)])
def test_sites_above_their_token_limit_take_xla(tokens, kernels, monkeypatch):
    """FusedMhcSite(max_tokens=4): a block of 4 tokens traces its two mHC sites as kernels, one of 5 tokens (a prefill
    chunk past the limit) the XLA composition only."""
    from dsv41 import model, quant
    from dsv41 import params as P
    from dsv41.config import preset

    cfg = preset("tiny")
    lp = P.init_tree(P.layer_specs(cfg, 0), cfg, seed=0)
    # one program (eagerly, a compile an op); pre stays weakly typed, as eagerly
    h, pre = jax.jit(lambda: (jnp.zeros((1, tokens, cfg.hc_mult, cfg.dim), jnp.bfloat16),
                              jnp.full((1, tokens, cfg.hc_mult), 1 / cfg.hc_mult)))()
    calls = []
    monkeypatch.setattr(BK, "mhc_fused", lambda *a, **kw: calls.append(kw["backend"]) or M.mhc_reference(*a[:10]))
    ops = BK.kernel_ops(mhc_site=BK.FusedMhcSite("interpret", max_tokens=4))
    jax.eval_shape(lambda h, pre, lp: model.block(h, pre, lp, 0, cfg, quant.Numerics(), lambda x, s: (x, s), ops=ops),
                   h, pre, lp)
    assert calls == (["interpret"] * 2 if kernels else [])


def test_bad_config_rejected():
    with pytest.raises(ValueError):
        M._build_kernel(4, 4, 256, False, M.KernelConfig(dc=64), interpret=True)
    with pytest.raises(ValueError):
        M._build_kernel(4, 4, 384, False, M.KernelConfig(dc=256), interpret=True)


def _shapes(t, d=CFG.dim, hc=4, first=False):
    sds = jax.ShapeDtypeStruct
    f32, bf16 = jnp.float32, jnp.bfloat16
    return [None if first else sds((t, d), bf16), sds((t, hc, d), bf16), None if first else sds((t, hc), f32),
            None if first else sds((t, hc, hc), f32), sds((t, hc), f32), sds((24, hc * d), f32),
            sds((3,), f32), sds((24,), f32), sds((d,), bf16)]


@pytest.mark.parametrize("t,first", [(1, False), (64, False), (512, False), (8, True)])
def test_kernel_lowers_for_cuda_at_flash_shapes(t, first):
    """The whole Pallas -> Mosaic GPU lowering (layouts, transfers, smem budget) runs on CPU."""
    shapes = _shapes(t, first=first)
    if first:
        f = jax.jit(lambda h, pre, fn, s, b, w: M.mhc_fused(None, h, None, None, pre, fn, s, b, w, CFG))
        shapes = [shapes[i] for i in (1, 4, 5, 6, 7, 8)]
    else:
        f = jax.jit(lambda *a: M.mhc_fused(*a, CFG))
    f.trace(*shapes).lower(lowering_platforms=("cuda",))


gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [1, 8, 64, 512])
@pytest.mark.parametrize("first", [False, True])
def test_kernel_gpu_flash_shapes(t, first):
    a = _data(jax.random.key(t), (t,), CFG.dim)
    if first:
        a[0] = a[2] = a[3] = None
    out = jax.jit(lambda *b: M.mhc_fused(*b, CFG, backend="pallas"))(*a)
    _check_kernel(out, a)
