"""The model under a device mesh: experts split over an 'expert' axis (expert parallelism), heads / expert width
/ vocabulary over a 'tensor' axis (tensor parallelism), as `checkpoint.sharding_for` places them on load. XLA
partitions the program (GSPMD) and inserts the collectives; the result must equal the single-device one.
Runs on the 8 virtual CPU devices of tests/conftest.py."""

import jax
import numpy as np
import pytest

from dsv41 import checkpoint, model, quant
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
    mesh = jax.make_mesh((4, 2), ("expert", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    _, sharded = checkpoint.load_checkpoint(path, mesh=mesh, dequantize="float32", progress=False)
    w1 = sharded["layers"][3]["ffn"]["experts"]["w1"]
    assert w1.sharding.spec[0] == "expert" and len(w1.addressable_shards) == 8
    assert w1.addressable_shards[0].data.shape[0] == cfg.n_routed_experts // 4
    ids = np.random.default_rng(3).integers(3, cfg.vocab_size, (2, 150)).astype(np.int32)
    ref = np.asarray(model.forward(one, cfg, ids, quant.EXACT_F32))
    got = model.forward(sharded, cfg, ids, quant.EXACT_F32)
    assert len(got.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=1e-4)
