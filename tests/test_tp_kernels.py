"""The kernel ops under tensor parallelism (8 virtual CPU devices, tests/conftest.py): each op on a TP2 / TP4 mesh
(`jax.set_mesh`; the op's own `shard_map` over the tensor axis, weights placed by dsv41.sharding's rules and
prepared by serving.engine.backends) against the same op on one device.

The kernels run as jnp models of themselves (`_kernel_models`): the Mosaic GPU interpreter keeps one process-wide
simulated GPU memory and cannot run a kernel on several devices at once (its barrier check fails when two devices'
kernels overlap). The models compute what the kernels do from the kernel layouts (the prepared weights, decoded by
the layouts' own inverses) with the kernels' bf16 output rounding, so what these tests check is the tensor-parallel
wiring: which slices each rank reads (the w13 block layout, column / row / group splits), the sums over ranks and the
prepared weights' placement. The kernels themselves are checked in tests/pallas_kernels.

Exact where a rank computes whole output columns; where ranks add partial sums (row-parallel linears, the
experts' F-slices) each rank's partial is rounded to bf16 (as the kernel's output is), so the result is checked
against the sum of the one-device op on each rank's slice (to float32 summation order) and loosely against the
unsplit op.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41 import mhc, moe, quant, sharding
from dsv41.config import preset
from dsv41.sharding import TensorShards
from pallas_kernels import expert_gemm, fp8_linear
from serving.engine import backends as BK

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (XLA_FLAGS host device count)")

NUM = quant.Numerics(act_quant=True, bf16_probs=True, dtype="bfloat16")
RNG = np.random.default_rng(0)


def _fp8_grouped_model(x, w, config=None):
    """fp8_linear.fp8_grouped_linear: x [G, M, K] -> bf16 [G, M, N], float32 accumulation."""
    wd = fp8_linear.unprepare_fp8_linear(w).dequantize(jnp.float32).reshape(w.weight.shape)
    return jnp.einsum("gmk,gnk->gmn", x.astype(jnp.float32), wd,
                      precision=jax.lax.Precision.HIGHEST).astype(jnp.bfloat16)


def _expert_matmul_model(xp, w, sched, cfg, interpret=False):
    """expert_gemm.matmul_padded: tile t = rows [tile_row[t], + tm) of xp times expert tile_expert[t]."""
    wd = expert_gemm.unprepare_fp4_experts(w).dequantize(jnp.float32)  # [E, N, K]
    rows = sched.tile_row[:, None] + jnp.arange(cfg.tm)[None]
    xs = jnp.take(xp.astype(jnp.float32), rows, axis=0, mode="fill", fill_value=0)  # [t_max, tm, K]
    we = jnp.take(wd, jnp.maximum(sched.tile_expert, 0), axis=0)  # [t_max, N, K]
    y = jnp.einsum("tmk,tnk->tmn", xs, we, precision=jax.lax.Precision.HIGHEST)
    return y.reshape(-1, wd.shape[1]).astype(jnp.bfloat16)


@pytest.fixture(autouse=True)
def _kernel_models(monkeypatch):
    monkeypatch.setattr(fp8_linear, "fp8_grouped_linear", _fp8_grouped_model)
    monkeypatch.setattr(expert_gemm, "matmul_padded", _expert_matmul_model)


def _mesh(t):
    par = sharding.Parallelism(tensor=t)
    return par, sharding.make_mesh(par)


def _place(w, axes, mesh, par):
    """w placed as the rules split a weight with these logical axes (weight and scale alike)."""
    arrays = jax.tree_util.tree_leaves(w)
    sh = sharding.weight_sharding(axes, mesh, [a.shape for a in arrays], par)
    return jax.tree_util.tree_map(lambda a: jax.device_put(a, sh), w)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


# ---- routed experts ---------------------------------------------------------------------------------------------

E, D, F, T, K = 4, 256, 512, 6, 2
EXPERT_AXES = {"w1": ("experts", "expert_ffn", "embed"), "w2": ("experts", "embed", "expert_ffn"),
               "w3": ("experts", "expert_ffn", "embed")}


def _fp4(shape):
    return quant.quantize_fp4_weight(jnp.asarray(RNG.standard_normal(shape) * 0.05, jnp.float32))


EXPERTS = {"w1": _fp4((E, F, D)), "w2": _fp4((E, D, F)), "w3": _fp4((E, F, D))}
X = jnp.asarray(RNG.standard_normal((T, D)), jnp.bfloat16)
IDX = jnp.asarray(np.stack([RNG.choice(E, K, replace=False) for _ in range(T)]), jnp.int32)
W = jnp.asarray(RNG.random((T, K)), jnp.float32)
CFG = dataclasses.replace(preset("tiny"), n_routed_experts=E, moe_inter_dim=F)


def _prepare(ex):
    return BK.prepare_experts({"layers": [{"ffn": {"experts": ex}}]}, interpret=True)["layers"][0]["ffn"]["experts"]


_run_experts = jax.jit(lambda x, w, idx, p: BK.routed_experts_op(x, w, idx, p, CFG, NUM))


def _width_slice(ex, r, t):
    """Rank r's F-slice of the FP4 experts (w1 / w3 rows, w2 columns), as one-device weights."""
    def cut(w, axis):
        return jax.tree_util.tree_map(lambda a: jax.lax.slice_in_dim(a, r * a.shape[axis] // t,
                                                                     (r + 1) * a.shape[axis] // t, axis=axis), w)
    return {"w1": cut(ex["w1"], 1), "w3": cut(ex["w3"], 1), "w2": cut(ex["w2"], 2)}


@pytest.mark.parametrize("t", [2, 4])
def test_routed_experts_split_over_the_width(t):
    par, mesh = _mesh(t)
    placed = _prepare({k: _place(w, EXPERT_AXES[k], mesh, par) for k, w in EXPERTS.items()})
    assert isinstance(placed["w13"], TensorShards) and placed["w13"].split(1) and placed["w2"].split(2)
    w13 = placed["w13"].value
    assert w13.weight.addressable_shards[0].data.shape == (E, 2 * F // t, D // 2)
    with jax.set_mesh(mesh):
        got = np.asarray(_run_experts(X, W, IDX, placed))
    ranks = sum(np.asarray(_run_experts(X, W, IDX, _prepare(_width_slice(EXPERTS, r, t)))) for r in range(t))
    np.testing.assert_allclose(got, ranks, rtol=1e-6, atol=1e-6)
    whole = np.asarray(_run_experts(X, W, IDX, _prepare(EXPERTS)))
    assert _rel(got, whole) < 1e-2  # per-rank bf16 rounding of the partial sums


@pytest.mark.parametrize("exchange", sharding.ALL2ALL_BACKENDS)
def test_routed_experts_under_expert_parallel_keep_their_experts_split(exchange):
    """DP2 x TP2 + EP: experts split over all four ranks on the expert axis, width whole; the prepared weights
    stay split as the FP4 ones (ExpertParallel's shard_map gives the kernel each rank's experts), whichever way
    the tokens travel (the ragged exchange through its CPU form)."""
    par = sharding.Parallelism(tensor=2, data=2, expert=True)
    mesh = sharding.make_mesh(par)
    placed = _prepare({k: _place(w, EXPERT_AXES[k], mesh, par) for k, w in EXPERTS.items()})
    w13 = placed["w13"]
    assert isinstance(w13, expert_gemm.PreparedFp4)
    assert w13.weight.addressable_shards[0].data.shape == (E // 4, 2 * F, D // 2)
    assert w13.scale_t.addressable_shards[0].data.shape == (E // 4, D // 32, 2 * F)
    want = np.asarray(_run_experts(X, W, IDX, _prepare(EXPERTS)))
    ep = sharding.ExpertParallel(BK.routed_experts_op, par.tensor, exchange, sharding.ragged_all_to_all_reference)
    R = sharding.rank_sharding(mesh).spec
    specs = jax.tree_util.tree_map(lambda a: sharding.manual_spec(a.sharding), placed)
    xs = jnp.tile(X[None], (2, 1, 1))  # each data rank the same tokens
    run = jax.jit(jax.shard_map(lambda p, x, w, i: ep(x[0], w[0], i[0], p, CFG, NUM)[None], mesh=mesh,
                                in_specs=(specs, R, R, R), out_specs=R, axis_names={sharding.DATA}))
    got = np.asarray(run(placed, xs, jnp.tile(W[None], (2, 1, 1)), jnp.tile(IDX[None], (2, 1, 1))))
    for d in range(2):
        np.testing.assert_allclose(got[d], want, rtol=1e-6, atol=1e-6)


# ---- FP8 linears ------------------------------------------------------------------------------------------------

N8 = 512
LIN_CFG = dataclasses.replace(preset("tiny"), o_groups=4)


def _fp8(shape):
    return quant.quantize_fp8_weight(jnp.asarray(RNG.standard_normal(shape) * 0.05, jnp.float32))


# wq_a replicated, wq_b column-parallel (heads), wo_b row-parallel (o_groups); wo_a [G * 128, in] grouped (dense
# FP8 values, as convert.py leaves it), its groups split
LINEARS = {"wq_a": (_fp8((N8, N8)), (None, "embed")), "wq_b": (_fp8((N8, N8)), ("heads", None)),
           "wo_b": (_fp8((N8, N8)), ("embed", "o_groups")),
           "wo_a": (_fp8((4 * 128, 256)).dequantize(jnp.bfloat16), ("o_groups", None))}
_lin = jax.jit(lambda x, w: BK.fp8_linear_op(x, w, NUM, fp8_input=True))
_grouped = jax.jit(lambda x, w: BK.fp8_grouped_linear_op(x, w, NUM))


def _prepare_linears(attn):
    return BK.prepare_linears({"layers": [{"attn": attn}]}, LIN_CFG, interpret=True)["layers"][0]["attn"]


@pytest.mark.parametrize("t", [2, 4])
def test_fp8_linears_split_as_their_weights(t):
    par, mesh = _mesh(t)
    one = _prepare_linears({k: w for k, (w, _) in LINEARS.items()})
    split = _prepare_linears({k: _place(w, axes, mesh, par) for k, (w, axes) in LINEARS.items()})
    assert all(isinstance(w, TensorShards) for w in split.values())
    assert not split["wq_a"].split(1) and not split["wq_a"].split(2)
    assert split["wq_b"].split(1) and split["wo_b"].split(2) and split["wo_a"].split(0)
    wo_b = split["wo_b"].value
    assert wo_b.weight.addressable_shards[0].data.shape == (1, N8, N8 // t)
    assert (N8 // t // fp8_linear.TK) % wo_b.splits == 0  # K slices of a rank's block
    x = jnp.asarray(RNG.standard_normal((3, N8)), jnp.bfloat16)
    xg = jnp.asarray(RNG.standard_normal((3, 4, 256)), jnp.bfloat16)
    with jax.set_mesh(mesh):
        got = {k: np.asarray(_lin(x, split[k]).astype(jnp.float32)) for k in ("wq_a", "wq_b", "wo_b")}
        got_g = np.asarray(_grouped(xg, split["wo_a"]).astype(jnp.float32))
    want = {k: np.asarray(_lin(x, one[k]).astype(jnp.float32)) for k in ("wq_a", "wq_b", "wo_b")}
    np.testing.assert_array_equal(got["wq_a"], want["wq_a"])
    np.testing.assert_array_equal(got["wq_b"], want["wq_b"])
    np.testing.assert_array_equal(got_g, np.asarray(_grouped(xg, one["wo_a"]).astype(jnp.float32)))
    # row-parallel: each rank's bf16 partial over its K-slice, summed
    w, _ = LINEARS["wo_b"]
    xq = quant.fp8_qdq(x)
    parts = []
    for r in range(t):
        cut = lambda a: jax.lax.slice_in_dim(a, r * a.shape[1] // t, (r + 1) * a.shape[1] // t, axis=1)
        ws = quant.Fp8Weight(cut(w.weight), cut(w.scale))
        parts.append(np.asarray(_fp8_grouped_model(cut(xq)[None], fp8_linear.prepare_fp8_linear(ws))[0],
                                np.float32))
    np.testing.assert_allclose(got["wo_b"], np.asarray(jnp.asarray(sum(parts)).astype(jnp.bfloat16), np.float32),
                               rtol=0, atol=0)
    assert _rel(got["wo_b"], want["wo_b"]) < 1e-2


# ---- replicated sites -------------------------------------------------------------------------------------------


def test_replicated_site_runs_whole_on_every_rank():
    """`TensorReplicated` (the mHC / router sites under TP): the op on replicated inputs on each rank, a None
    argument and the config passed through; the result is the op's."""
    cfg = preset("tiny")
    par, mesh = _mesh(2)
    hc, Dm = cfg.hc_mult, cfg.dim
    mix = (2 + hc) * hc
    h = jnp.asarray(RNG.standard_normal((2, 3, hc, Dm)), jnp.float32)
    pre = jnp.asarray(RNG.random((2, 3, hc)), jnp.float32)
    args = (None, h, None, None, pre, jnp.asarray(RNG.standard_normal((mix, hc * Dm)) * 0.01, jnp.float32),
            jnp.ones((3,), jnp.float32), jnp.asarray(RNG.standard_normal(mix) * 0.1, jnp.float32),
            jnp.ones((Dm,), jnp.float32), cfg)
    want = jax.jit(lambda *a: mhc.site(*a, cfg))(*args[:-1])
    site = sharding.TensorReplicated(mhc.site)
    with jax.set_mesh(mesh):
        hs = jax.device_put(h, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, None, "tensor")))
        got = jax.jit(lambda *a: site(*a, cfg))(args[0], hs, *args[2:-1])
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_build_takes_kernels_with_tensor_parallelism():
    """backends.build on TP2-placed release-format weights: the FP8 linears whose rank slices the kernel takes
    become `TensorShards` (the shared expert's 64-wide slices of the tiny preset stay FP8 for XLA), the mHC
    site runs replicated per rank; the KV path's kernels are taken; an expert width a rank cannot take is refused."""
    from dsv41 import params as P

    cfg = preset("tiny")
    par, mesh = _mesh(2)
    params = sharding.place_params(P.init_params(cfg, seed=0), cfg, par, mesh)
    params = {k: v for k, v in params.items() if k != "vision"}
    backends, prepared = BK.build(cfg, params, NUM, attention="auto", moe_backend="xla", mhc_backend="interpret",
                                  router_backend="xla", linear_backend="interpret", parallelism=par)
    attn = prepared["layers"][0]["attn"]
    assert attn["wq_b"].split(1) and attn["wo_b"].split(2) and not attn["wq_a"].split(1)
    assert isinstance(prepared["layers"][0]["ffn"]["shared_experts"]["w1"], quant.Fp8Weight)
    assert backends.attention == "xla" and backends.ops.linear is BK.fp8_linear_op
    assert isinstance(backends.ops.mhc_site, sharding.TensorReplicated)
    assert backends.ops.route is moe.route_plain  # (the tiny preset's 8 experts: no router kernel)
    assert BK.build(cfg, params, NUM, attention="interpret", parallelism=par)[0].attention == "interpret"
    with pytest.raises(BK.BackendError, match="expert width a multiple of 128"):
        BK.build(cfg, params, NUM, moe_backend="interpret", parallelism=par)


def test_decode_kv_path_per_tensor_rank():
    """One KV-source layer with an indexer (tiny layer 2) decoding through the KV path's kernels (their jnp
    references: no interpreter) on TP2-placed weights: the KV writes and the indexer whole on each rank, the
    sparse attention on each rank's heads, each in its own shard_map over the tensor axis. The pool it writes and
    the entries it picks equal one device's; its output too, to float32 summation order (wo_b's row split)."""
    import tiny_engine
    from layer_paths import make_batch, zero_rows

    from dsv41 import model
    from dsv41.layer_plan import Carry
    from serving.engine import kv_pool, programs

    cfg, params = tiny_engine.tiny()
    num, layer, B, T = tiny_engine.NUM, 2, 2, 128
    freqs = model.freqs_for(cfg)[layer]
    bt = np.arange(B * 3).reshape(B, 3)
    x = jnp.asarray(RNG.standard_normal((B, T + 1, cfg.dim)), jnp.float32)
    prefill = make_batch(np.zeros((B, T)), 0, [T, T], [0, 1], bt, zero_rows(cfg, B, T), cfg.n_layers)
    decode = make_batch(np.zeros((B, 1)), T, [1, 1], [0, 1], bt, zero_rows(cfg, B, 1), cfg.n_layers)

    def step(lp, pool, x):  # a prefill chunk through XLA, then one decode token through the kernels' path
        _, pool, _ = programs.cached_attention(x[:, :T], lp, layer, cfg, num, pool, prefill, Carry(), freqs, "full")
        y, pool, carry = programs.cached_attention(x[:, T:], lp, layer, cfg, num, pool, decode, Carry(), freqs,
                                                   "full", BK.Backends("reference"))
        return y, pool, carry.topk

    pool = kv_pool.allocate(cfg, kv_pool.PoolLayout(num_pages=8, page_tokens=64, num_slots=2))
    want = jax.jit(step)(params["layers"][layer]["attn"], pool, x)
    par, mesh = _mesh(2)
    lp = sharding.place_params(params, cfg, par, mesh)["layers"][layer]["attn"]
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    pool, x = jax.device_put((pool, x), rep)
    prefill, decode = jax.device_put((prefill, decode), rep)
    with jax.set_mesh(mesh):
        run = jax.jit(step)
        assert str(jax.make_jaxpr(step)(lp, pool, x)).count("shard_map") == 3  # KV write, indexer, attention
        got = run(lp, pool, x)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))  # the indexer's entries
    assert int((np.asarray(want[2]) >= 0).sum()) > 0
    for g, w in zip(jax.tree_util.tree_leaves(got[1]), jax.tree_util.tree_leaves(want[1])):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
