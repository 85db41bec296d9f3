"""Fused MoE router: reference semantics vs dsv41.moe.route, the counting-sort permutation, the Mosaic GPU
kernels in the Mosaic GPU interpreter (CPU), and the real Pallas -> Mosaic GPU lowering at Flash's shapes.
GPU-only tests run the compiled kernels (marked `gpu`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41.config import ModelConfig
from pallas_kernels import router as R
from serving.engine import backends as BK

RC = R.RouteConfig()  # Flash: k=6, route_scale 1.5, renormalised
SMALL = R.KernelConfig(tm=8, tk=64, splits=2, num_wgs=2, stages=2)  # interpret: D=128 in 2 splits of 64


# Each test's kernel call and reference run as jitted programs: eagerly, their array preparation and
# post-processing are dozens of small programs, each an XLA compile (~40 ms on the CPU): most of this file's time.
_reference = jax.jit(R.route_reference, static_argnums=2)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _route_interpret(x, w, bias, rc, config):
    return R.route_pallas(x, w, bias, rc, config, interpret=True)


def _cfg(k=6, e=384):
    return dataclasses.replace(ModelConfig(), n_activated_experts=k, n_routed_experts=e)


def _data(seed, t, d, e, gap=2e-3):
    """Random routing data without near-ties: the biases are spaced so that the top-k keys of a token
    are separated by far more than the GEMM's rounding differences (about 1e-6 here)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((e, d)) * 0.1, jnp.bfloat16)
    bias = jnp.asarray(rng.permutation(e) * gap, jnp.float32)
    return x, w, bias


def _check_against_reference(out, x, w, bias, rc=RC, tie_gap=0.0):
    """ids identical (rows whose reference top-(k+1) keys are closer than tie_gap excepted), weights close,
    order and group sizes identical when all ids are."""
    wts, ids, order, sizes = (np.asarray(a) for a in out)
    rw, rids, rorder, rsizes = (np.asarray(a) for a in _reference(x, {"weight": w, "bias": bias}, rc))
    t = x.shape[0]
    assert wts.shape == (t, rc.k) and ids.shape == (t, rc.k) and order.shape == (t * rc.k,)
    bad = (ids != rids).any(axis=1)
    if tie_gap > 0 and bad.any():
        keys = np.asarray(R.scores_reference(x, w)) + np.asarray(bias)[None]
        top = -np.sort(-keys, axis=1)[:, :rc.k + 1]
        near = (np.diff(-top, axis=1) < tie_gap).any(axis=1)
        assert not (bad & ~near).any(), np.argwhere(bad & ~near)[:5]
        keep = ~bad
        np.testing.assert_allclose(wts[keep], rw[keep], rtol=2e-5, atol=1e-6)
        return
    assert not bad.any(), np.argwhere(ids != rids)[:5]
    # bf16 x bf16 products are exact in f32; the sums differ from the HIGHEST-precision reference only in
    # order (wgmma + split-K vs XLA), and softplus uses log-based log1p: a few f32 ulp.
    np.testing.assert_allclose(wts, rw, rtol=2e-5, atol=1e-6)
    assert (order == rorder).all() and (sizes == rsizes).all()


def test_reference_matches_moe_route():
    """route_reference (HIGHEST f32) and today's XLA path pick the same experts and weights."""
    x, w, bias = _data(0, 37, 256, 384)
    cfg = _cfg()
    gate = {"weight": w, "bias": bias, "bias_vl": bias}
    out = jax.jit(lambda x, gate: R.route_fused(x, gate, cfg, backend="xla"))(x, gate)
    _check_against_reference(out, x, w, bias)


@pytest.mark.parametrize("t,e,k", [(5, 16, 6), (100, 384, 6)])
def test_permutation_count_equals_argsort(t, e, k):
    rng = np.random.default_rng(t)
    ids = jnp.asarray(rng.integers(0, e, (t, k)), jnp.int32)
    (o1, s1), (o2, s2) = jax.jit(lambda ids: [R.permutation(ids, e, m) for m in ("argsort", "count")])(ids)
    assert (np.asarray(o1) == np.asarray(o2)).all() and (np.asarray(s1) == np.asarray(s2)).all()
    assert int(np.asarray(s2).sum()) == t * k


@pytest.mark.parametrize("t", [70])
def test_kernel_interpret_matches_reference(t):
    """T=70: two epilogue tiles (Tp=128, rows 70..127 padding), 9 GEMM tiles, prefill's 2 warpgroups, no
    split. (T <= 64, where the epilogue reads only round_up(T, 8) rows, 2 D splits and the decode's single
    warpgroup are covered by the ties test with T=3.)"""
    d, e = 64, 128
    x, w, bias = _data(10 + t, t, d, e)
    out = _route_interpret(x, w, bias, RC, dataclasses.replace(SMALL, splits=1))
    _check_against_reference(out, x, w, bias)


def test_kernel_interpret_exact_ties_go_to_lower_id():
    """Duplicated gate rows give bit-identical scores: top_k's rule (lower id first) must hold, both within
    a 128-expert chunk and across chunks."""
    d, e, t = 128, 256, 3
    x, w, _ = _data(7, t, d, e)
    w = np.array(w.astype(jnp.float32))
    bias = np.zeros(e, np.float32)
    for a, b in [(3, 40), (200, 9), (130, 131)]:  # (copy-from, copy-to): ties across and within chunks
        w[b] = w[a]
    bias[[3, 40, 200, 9, 130, 131]] = 10.0  # make the six tied experts the top-6
    w = jnp.asarray(w, jnp.bfloat16)
    bias = jnp.asarray(bias)
    out = _route_interpret(x, w, bias, RC, dataclasses.replace(SMALL, num_wgs=1))  # decode WGs
    ids = np.asarray(out[1])
    assert sorted(ids[0].tolist()) == [3, 9, 40, 130, 131, 200]
    _check_against_reference(out, x, w, bias)
    # Order within a tie: the lower id first.
    for row in ids:
        for lo, hi in [(3, 40), (9, 200), (130, 131)]:
            assert list(row).index(lo) < list(row).index(hi)


def _select_interpret(logits, bias, rc=RC):
    """The selection kernel alone in the interpreter: logits f32 [T, E] -> (weights [T, k], ids [T, k]) as
    numpy arrays, and select_reference's (weights, ids) on the same logits."""
    return [np.asarray(a) for a in _select_and_reference(logits, bias, rc)]


@functools.partial(jax.jit, static_argnums=2)
def _select_and_reference(logits, bias, rc):
    t, e = logits.shape
    r, tb = R.select_tiling(e, rc.k)
    tp = -(-t // tb) * tb
    lg = R.select_rows(jnp.pad(logits, ((0, tp - t), (0, 0))).T, r, tb)
    w_t, i_t = R._select_kernel(tp, e, rc, True)(lg, bias.reshape(r, 64))
    assert w_t.shape == (tp // tb, rc.k, 64)
    w = jnp.swapaxes(w_t[:, :, :tb], 1, 2).reshape(-1, rc.k)[:t]
    ids = jnp.swapaxes(i_t[:, :, :tb], 1, 2).reshape(-1, rc.k)[:t]
    return (w, ids, *R.select_reference(jnp.sqrt(jax.nn.softplus(logits)), bias, rc))


@pytest.mark.parametrize("t,e", [(11, 384), (5, 320), (70, 64), (9, 512)])
def test_select_kernel_interpret_matches_reference(t, e):
    """The two-level selection at each row count a token can take (r = E/64 rows of 64 experts: 6 for Flash,
    tb = 8 tokens a CTA; 5 (40 of 64 rows used); 1 (64 tokens a CTA, the second CTA ragged); 8 (all 64 rows)),
    ragged token counts, fresh random logits of the model's scale and spaced biases (no near-ties)."""
    rng = np.random.default_rng(1000 + t + e)
    logits = jnp.asarray(rng.standard_normal((t, e)) * 1.4, jnp.float32)
    bias = jnp.asarray(rng.permutation(e) * 2e-3, jnp.float32)
    w, ids, rw, rids = _select_interpret(logits, bias)
    np.testing.assert_array_equal(ids, rids)
    np.testing.assert_allclose(w, rw, rtol=2e-5, atol=1e-6)


def test_select_kernel_interpret_top_k_within_one_row_or_spread():
    """A token whose k best experts all sit in one row of 64 (level 1 must keep k a row, level 2 then takes
    them all), one with its k best in k different rows, and one with exact ties across rows and within a row
    (bit-equal logits: the lower id first, as top_k)."""
    e, k = 384, RC.k
    rng = np.random.default_rng(5)
    logits = np.asarray(rng.standard_normal((3, e)) * 0.5, np.float32)
    logits[0, 70:70 + k] = 8.0 + np.arange(k)  # all in row 1
    logits[1, [5, 100, 130, 250, 300, 383]] = 9.0 - np.arange(k)  # one a row, descending
    logits[2, [200, 9, 130, 131, 3, 40]] = 7.0  # six equal keys: ids ascending is the order
    bias = jnp.zeros((e,), jnp.float32)
    w, ids, _, rids = _select_interpret(jnp.asarray(logits), bias)
    np.testing.assert_array_equal(ids, rids)
    assert ids[0].tolist() == list(range(70 + k - 1, 69, -1))
    assert ids[1].tolist() == [5, 100, 130, 250, 300, 383]
    assert ids[2].tolist() == [3, 9, 40, 130, 131, 200]
    np.testing.assert_allclose(w.sum(axis=1), RC.route_scale, rtol=1e-6)


def test_image_mask_falls_back_to_xla():
    x, w, bias = _data(3, 4, 64, 128)
    gate = {"weight": w, "bias": bias, "bias_vl": -bias}
    cfg = _cfg(e=128)
    mask = jnp.asarray([True, False, True, False])
    from dsv41 import moe

    @jax.jit  # one program (see _reference)
    def both(x, gate, mask):
        return moe.route(x, gate, cfg, mask), R.route_fused(x, gate, cfg, backend="interpret", image_mask=mask)

    (rw, rids), (w_, ids, _, _) = both(x, gate, mask)
    assert (np.asarray(ids) == np.asarray(rids)).all() and (np.asarray(w_) == np.asarray(rw)).all()


def test_moe_with_fused_router_matches_xla():
    """dsv41.moe.moe routed by the kernels (interpreter, with their permutation handed to the expert GEMMs)
    against the XLA route, tiny widths with 64 experts (one of the kernel's 64-expert warpgroups)."""
    from dsv41 import moe, quant
    from dsv41 import params as P
    from dsv41.config import preset

    cfg = dataclasses.replace(preset("tiny"), n_routed_experts=64)
    ffn = P.init_tree(P.layer_specs(cfg, 0)["ffn"], cfg, seed=1)
    x, _, bias = _data(5, 6, cfg.dim, cfg.n_routed_experts)
    ffn = {**ffn, "gate": {**ffn["gate"], "bias": bias}}  # spaced biases: no near-ties in the top-k
    num = quant.Numerics(act_quant=False)
    out = {}
    for be in ("xla", "interpret"):
        # params as arguments: closed over, they become constants and the compile takes 10x longer
        ops = BK.kernel_ops(router=be)
        out[be] = jax.jit(lambda x, p, ops=ops: moe.moe(x, p, cfg, num, return_routing=True, ops=ops))(x, ffn)
        jax.block_until_ready(out[be])
    (yx, (wx, ix)), (yk, (wk, ik)) = out["xla"], out["interpret"]
    np.testing.assert_array_equal(np.asarray(ik), np.asarray(ix))
    np.testing.assert_allclose(np.asarray(wk), np.asarray(wx), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(yk, np.float32), np.asarray(yx, np.float32), rtol=2 ** -7, atol=1e-6)


def test_lowering_for_cuda_at_flash_shapes():
    """The whole Pallas -> Mosaic GPU lowering (layouts, smem budget, wgmma shapes, TMA descriptors) at
    D=5120, E=384: the full route with the T=1 decode config at T=17 (also the x padding for T % 8 != 0, which
    TMA needs), the gate kernel at exactly T=1, and the prefill gate config (tm=128, no split) at T=4096."""
    d, e = 5120, 384
    dec = R.default_config(1, d, e)
    assert (dec.tm, dec.splits, dec.num_wgs) == (8, 20, 1)
    f = lambda x, w, b: R.route_pallas(x, w, b, RC, dec)
    args = (jax.ShapeDtypeStruct((17, d), jnp.bfloat16), jax.ShapeDtypeStruct((e, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((e,), jnp.float32))
    jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    for t, cfg, t_pad in ((1, dec, 8), (4096, R.default_config(4096, d, e), 4096)):
        g = R._gate_kernel(t_pad, d, e, cfg, False)
        jax.jit(g).trace(jax.ShapeDtypeStruct((t, d), jnp.bfloat16),
                         jax.ShapeDtypeStruct((e, d), jnp.bfloat16)).lower(lowering_platforms=("cuda",))
    assert R.default_config(4096, d, e).splits == 1 and R.default_config(4096, d, e).tm == 128
    # the selection kernel at the bench preset's 64 experts (one row a token) and at 512 (all 64 rows used)
    for e_, t_pad in ((64, 64), (512, 16)):
        r, _ = R.select_tiling(e_, RC.k)
        jax.jit(R._select_kernel(t_pad, e_, RC, False)).trace(
            jax.ShapeDtypeStruct((t_pad * r, 64), jnp.float32),
            jax.ShapeDtypeStruct((r, 64), jnp.float32)).lower(lowering_platforms=("cuda",))


gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [1, 8, 64, 512, 4096])
def test_kernel_gpu_flash_shapes(t):
    x, w, bias = _data(100 + t, t, 5120, 384)
    out = jax.jit(lambda x, w, b: R.route_pallas(x, w, b, RC))(x, w, bias)
    _check_against_reference(out, x, w, bias, tie_gap=1e-5)  # T=4096 may hold a few near-ties
