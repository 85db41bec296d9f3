"""The model under a device mesh: dsv41.sharding's layouts (TP: heads / FFN width / vocabulary over 'tensor'; DEP:
experts over data x tensor, attention per data rank), as `checkpoint.load_checkpoint(mesh=)` places them. XLA
partitions the program (GSPMD) and inserts the collectives; the result must equal the single-device one up to
float32 summation order. Runs on the 8 virtual CPU devices of tests/conftest.py.

Summation order can still flip a top-k choice where two scores tie to a few ulps (seen: indexer scores 0.25186828
vs 0.2518683 at the boundary, on one machine and XLA optimisation level, not another). So the selections are
compared first: where they first differ in a row, the flip must be such a tie, and that row's logits are compared
up to that position; everything else must match to float32 noise."""

import re

import jax
import numpy as np
import pytest

from dsv41 import checkpoint, model, quant, sharding, trace_diff
from dsv41.config import preset
from dsv41.params import init_params
from dsv41.tokenizer import BUILTIN_DIR


needs8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS host device count)")


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """The tiny preset written once, and its one-device float32 forward on one short batch."""
    cfg = preset("tiny")
    path = checkpoint.save_checkpoint(init_params(cfg, seed=2), cfg, tmp_path_factory.mktemp("ck") / "ck",
                                      tokenizer_dir=BUILTIN_DIR)
    _, one = checkpoint.load_checkpoint(path, dequantize="float32", progress=False)
    ids = np.random.default_rng(3).integers(3, cfg.vocab_size, (2, 150)).astype(np.int32)
    return cfg, path, ids, model.forward_with_trace(one, cfg, ids, quant.EXACT_F32)


@needs8
@pytest.mark.parametrize("par", [sharding.Parallelism(tensor=2, data=4, expert=True), sharding.Parallelism(tensor=4)],
                         ids=["dp4xtp2+ep", "tp4"])
def test_forward_on_a_mesh_equals_one_device(tiny_ckpt, par):
    cfg, path, ids, (ref, ref_trace) = tiny_ckpt
    mesh = sharding.make_mesh(par)
    _, sharded = checkpoint.load_checkpoint(path, mesh=mesh, dequantize="float32", progress=False)
    w1 = sharded["layers"][3]["ffn"]["experts"]["w1"]
    assert len(w1.addressable_shards) == par.devices
    assert w1.addressable_shards[0].data.shape[0] == cfg.n_routed_experts // par.expert_ranks
    got, got_trace = model.forward_with_trace(sharded, cfg, ids, quant.EXACT_F32)
    assert len(got.sharding.device_set) == par.devices
    flips = trace_diff.first_flips(ref_trace, got_trace, cfg.n_layers)
    for f in flips.values():
        assert f.name == "topk" and f.spread <= 1e-5, f"not a top-k tie: {f}"
    first = trace_diff.compared_prefix(flips, *ids.shape)
    assert first.sum() >= 0.8 * ids.size, f"selections flip early: {flips}"
    ref, got = np.asarray(ref), np.asarray(got)
    for row, stop in enumerate(first):
        np.testing.assert_allclose(got[row, :stop], ref[row, :stop], rtol=0, atol=1e-4, err_msg=f"row {row}")


@needs8
def test_per_device_bytes_equals_a_sharded_load(tiny_ckpt):
    cfg, path, _, _ = tiny_ckpt
    par = sharding.Parallelism(tensor=2, data=4, expert=True)
    mesh = sharding.make_mesh(par)
    _, placed = checkpoint.load_checkpoint(path, mesh=mesh, progress=False)
    on_device = [x for x in jax.tree_util.tree_leaves(placed) if isinstance(x, jax.Array)]
    real: dict = {}
    for x in on_device:
        for shard in x.addressable_shards:
            real[shard.device] = real.get(shard.device, 0) + shard.data.nbytes
    structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in on_device]
    got = sharding.per_device_bytes(structs, [x.sharding for x in on_device])
    assert got == real and len(got) == 8
    full = sum(x.nbytes for x in on_device)
    assert max(got.values()) < full  # something is split, not copied everywhere


def _specs(cfg, par):
    mesh = sharding.make_mesh(par)
    sh = sharding.param_shardings(cfg, par, mesh, dtype="float32")
    return jax.tree_util.tree_map(lambda s: tuple(s.spec), sh, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))


@needs8
@pytest.mark.parametrize("par, expect", [
    (sharding.Parallelism(tensor=4),
     {"wq_b": ("tensor", None), "wo_a": ("tensor", None), "wo_b": (None, "tensor"), "wkv": (None, None),
      "ix_wq_b": ("tensor", None), "w1": (None, "tensor", None), "sh_w2": (None, "tensor"),
      "head": ("tensor", None), "embed": ("tensor", None)}),
    (sharding.Parallelism(data=4, expert=True),
     {"wq_b": (None, None), "wo_b": (None, None), "wkv": (None, None), "ix_wq_b": (None, None),
      "w1": ("data", None, None), "sh_w2": (None, None), "head": (None, None)}),
    (sharding.Parallelism(tensor=2, data=2, expert=True),
     {"wq_b": ("tensor", None), "wo_a": ("tensor", None), "wkv": (None, None), "ix_wq_b": ("tensor", None),
      "w1": (("data", "tensor"), None, None), "w2": (("data", "tensor"), None, None), "sh_w2": (None, "tensor"),
      "head": ("tensor", None)}),
])
def test_rules_place_representative_weights(par, expect):
    specs = _specs(preset("tiny"), par)
    layer = specs["layers"][2]
    got = {"wq_b": layer["attn"]["wq_b"], "wo_a": layer["attn"]["wo_a"], "wo_b": layer["attn"]["wo_b"],
           "wkv": layer["attn"]["wkv"], "ix_wq_b": layer["attn"]["indexer"]["wq_b"],
           "w1": layer["ffn"]["experts"]["w1"], "w2": layer["ffn"]["experts"]["w2"],
           "sh_w2": layer["ffn"]["shared_experts"]["w2"], "head": specs["head"], "embed": specs["embed"]}
    assert {k: got[k] for k in expect} == expect


@pytest.mark.parametrize("par, n, message", [
    (sharding.Parallelism(tensor=3), 8, "attention heads (n_heads) = 8 cannot be split 3 ways"),
    (sharding.Parallelism(tensor=8), 8, "output groups (o_groups) = 4 cannot be split 8 ways"),
    (sharding.Parallelism(tensor=2, data=8, expert=True), 16, "routed experts (n_routed_experts) = 8 cannot be "
                                                              "split 16 ways"),
    (sharding.Parallelism(tensor=4, data=4), 8, "asks for 16 devices but 8 are present"),
    (sharding.Parallelism(tensor=2, expert=True), 8, "expert parallelism needs --data-parallel-size > 1"),
    (sharding.Parallelism(tensor=0), 8, "must be >= 1"),
    (sharding.Parallelism(data=2, all2all="ragged_all_to_all"), 8, "add --enable-expert-parallel"),
    (sharding.Parallelism(data=2, expert=True, all2all="nccl"), 8, "unknown --all2all-backend 'nccl'"),
])
def test_bad_layouts_get_one_clear_error(par, n, message):
    with pytest.raises(sharding.ParallelismError, match=re.escape(message)):
        par.validate(preset("tiny"), n)


def test_good_layouts_validate():
    for par in (sharding.Parallelism(), sharding.Parallelism(tensor=4), sharding.Parallelism(data=8, expert=True),
                sharding.Parallelism(tensor=2, data=2, expert=True), sharding.Parallelism(tensor=2, data=4)):
        par.validate(preset("tiny"), 8)


@needs8
def test_ragged_all_to_all_reference_follows_the_documented_semantics():
    """`sharding.ragged_all_to_all_reference` (the CPU's stand-in for `jax.lax.ragged_all_to_all`) against the
    send / receive loop of jax's docstring, written out in numpy: uneven sizes, empty slices, slices placed out of
    order and the output's own values kept where nothing lands."""
    n, rows, out_rows = 4, 6, 9
    rng = np.random.default_rng(0)
    operand = rng.standard_normal((n, rows, 3)).astype(np.float32)
    output = rng.standard_normal((n, out_rows, 3)).astype(np.float32)
    send = rng.integers(0, 3, (n, n)).astype(np.int32)  # send[s, d]: rows s sends d
    in_off = np.stack([rng.integers(0, rows - send[s].max() + 1, n) for s in range(n)]).astype(np.int32)
    out_off = np.zeros((n, n), np.int32)  # out_off[s, d]: where s's rows land on d, disjoint per receiver
    for d in range(n):
        at = 0
        for s in rng.permutation(n):
            out_off[s, d], at = at, at + send[s, d] + 1
    want = output.copy()
    for s in range(n):
        for d in range(n):
            want[d, out_off[s, d]:out_off[s, d] + send[s, d]] = operand[s, in_off[s, d]:in_off[s, d] + send[s, d]]
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
    P = jax.sharding.PartitionSpec

    def f(a, o, io, ss, oo, rs):
        return sharding.ragged_all_to_all_reference(a[0], o[0], io[0], ss[0], oo[0], rs[0], axis_name="x")[None]

    args = [jax.device_put(a, jax.NamedSharding(mesh, P("x"))) for a in (operand, output, in_off, send, out_off,
                                                                         send.T.copy())]
    got = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))(*args)
    np.testing.assert_array_equal(np.asarray(got), want)
