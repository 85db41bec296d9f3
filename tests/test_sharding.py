"""The model under a device mesh: experts split over an 'expert' axis (expert parallelism), heads / expert width
/ vocabulary over a 'tensor' axis (tensor parallelism), as `checkpoint.sharding_for` places them on load. XLA
partitions the program (GSPMD) and inserts the collectives; the result must equal the single-device one up to
float32 summation order. Runs on the 8 virtual CPU devices of tests/conftest.py.

Summation order can still flip a top-k choice where two scores tie to a few ulps (seen: indexer scores 0.25186828
vs 0.2518683 at the boundary, on one machine and XLA optimisation level, not another). So the selections are
compared first: where they first differ in a row, the flip must be such a tie, and that row's logits are compared
up to that position; everything else must match to float32 noise."""

import jax
import numpy as np
import pytest

from dsv41 import checkpoint, model, quant, sharding, trace_diff
from dsv41.config import preset
from dsv41.params import init_params
from dsv41.tokenizer import BUILTIN_DIR


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS host device count)")
def test_forward_on_an_expert_x_tensor_mesh_equals_one_device(tmp_path):
    cfg = preset("tiny")
    path = checkpoint.save_checkpoint(init_params(cfg, seed=2), cfg, tmp_path / "ck", tokenizer_dir=BUILTIN_DIR)
    _, one = checkpoint.load_checkpoint(path, dequantize="float32", progress=False)
    # Auto axes: XLA's partitioner places the activations (jax.make_mesh defaults to Explicit axes, under which
    # every gather would need its output sharding spelled out)
    mesh = sharding.make_mesh(sharding.Parallelism(tensor=2, data=4, expert=True))
    _, sharded = checkpoint.load_checkpoint(path, mesh=mesh, dequantize="float32", progress=False)
    w1 = sharded["layers"][3]["ffn"]["experts"]["w1"]
    assert w1.sharding.spec[0] == ("data", "tensor") and len(w1.addressable_shards) == 8
    assert w1.addressable_shards[0].data.shape[0] == cfg.n_routed_experts // 8
    ids = np.random.default_rng(3).integers(3, cfg.vocab_size, (2, 150)).astype(np.int32)
    ref, ref_trace = model.forward_with_trace(one, cfg, ids, quant.EXACT_F32)
    got, got_trace = model.forward_with_trace(sharded, cfg, ids, quant.EXACT_F32)
    assert len(got.sharding.device_set) == 8
    flips = trace_diff.first_flips(ref_trace, got_trace, cfg.n_layers)
    for f in flips.values():
        assert f.name == "topk" and f.spread <= 1e-5, f"not a top-k tie: {f}"
    first = trace_diff.compared_prefix(flips, *ids.shape)
    assert first.sum() >= 0.8 * ids.size, f"selections flip early: {flips}"
    ref, got = np.asarray(ref), np.asarray(got)
    for row, stop in enumerate(first):
        np.testing.assert_allclose(got[row, :stop], ref[row, :stop], rtol=0, atol=1e-4, err_msg=f"row {row}")
