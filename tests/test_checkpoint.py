"""Release-format checkpoints: writer, validating loader, orbax restarts (spec §5)."""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41 import checkpoint as ckpt
from dsv41 import model, quant, tokenizer
from dsv41 import safetensors_io as st
from dsv41.config import preset
from dsv41.params import abstract_params, dequantize_params, init_params, is_weight_leaf

ASSETS = os.path.join(os.path.dirname(ckpt.__file__), "assets")


@pytest.fixture(scope="module")
def cfg():
    return preset("tiny")


@pytest.fixture(scope="module")
def params(cfg):
    return init_params(cfg, seed=0)


@pytest.fixture(scope="module")
def ckpt_dir(cfg, params, tmp_path_factory):
    return ckpt.save_checkpoint(params, cfg, tmp_path_factory.mktemp("release") / "ck", tokenizer_dir=ASSETS)


@pytest.fixture(scope="module")
def stored(ckpt_dir):
    return ckpt.load_checkpoint(ckpt_dir)[1]


def _dequantize(params, dtype):
    """dequantize_params in one compiled program (eagerly it dispatches thousands of small ops)."""
    return jax.jit(dequantize_params, static_argnums=1)(params, dtype)


def _bytes(x) -> np.ndarray:
    a = np.asarray(x)
    return a.reshape(-1).view(np.uint8)


def assert_trees_bit_equal(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
        name = jax.tree_util.keystr(path)
        assert np.dtype(x.dtype) == np.dtype(y.dtype) and tuple(x.shape) == tuple(y.shape), name
        assert np.array_equal(_bytes(x), _bytes(y)), name


def _header_table(path) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {k: (dt, shape) for k, dt, shape, _ in ckpt.iter_release_tensors(path)}


# ---- round trips ------------------------------------------------------------------------------------------


def weights(tree: dict) -> dict:
    """The tree without a loaded checkpoint's Engram token map (`model.TOKEN_MAP_KEY`, not a weight)."""
    return {k: v for k, v in tree.items() if k != model.TOKEN_MAP_KEY}


def test_round_trip_is_bit_exact(cfg, params, ckpt_dir, stored):
    assert_trees_bit_equal(params, weights(stored))
    # the checkpoint's tokenizer (here the built-in one) comes with it, as its Engram classes
    np.testing.assert_array_equal(stored[model.TOKEN_MAP_KEY], tokenizer.builtin_compressed_token_map()[0])
    assert ckpt.load_checkpoint(ckpt_dir, cfg)[0] == cfg
    table = stored["layers"][1]["engram"]["embed"]
    assert isinstance(table, quant.Fp8Rows) and isinstance(table.weight, np.ndarray)  # on the host
    for a in (table.weight, table.scale):  # memory-mapped, never copied
        assert not a.flags.owndata and not a.flags.writeable
    assert isinstance(stored["layers"][0]["ffn"]["experts"]["w1"], quant.Fp4Weight)


def test_resident_tables_are_in_memory_and_equal(cfg, stored, tmp_path):
    """`--engram-tables ram`: the mapped tables (release files, and orbax's .npy maps) become host arrays of
    their own with the same bytes, read in chunks; everything else is the same objects."""
    for tree in (stored, ckpt.load_orbax(ckpt.save_orbax(stored, cfg, tmp_path / "orbax"))[1]):
        ram = ckpt.resident_tables(tree, progress=False, chunk_bytes=1000)  # several chunks per table
        assert_trees_bit_equal(tree, ram)
        for i in cfg.engram_layer_ids:
            for a in (ram["layers"][i]["engram"]["embed"].weight, ram["layers"][i]["engram"]["embed"].scale):
                assert a.flags.owndata and isinstance(a, np.ndarray) and not isinstance(a, np.memmap)
        assert ram["layers"][0]["ffn"]["experts"]["w1"] is tree["layers"][0]["ffn"]["experts"]["w1"]
        assert ckpt.resident_tables(ram, progress=False) is ram  # nothing left to read


def test_pread_read_mode_is_bit_exact(ckpt_dir, stored):
    assert_trees_bit_equal(stored, ckpt.load_checkpoint(ckpt_dir, read_mode="pread", workers=3)[1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dequantized_load_equals_dequantize_params(ckpt_dir, stored, dtype):
    _, dense = ckpt.load_checkpoint(ckpt_dir, dequantize=dtype)
    assert_trees_bit_equal(_dequantize(weights(stored), dtype), weights(dense))
    assert dense[model.TOKEN_MAP_KEY] is not None


def test_orbax_round_trip_is_exact(cfg, stored, tmp_path):
    path = ckpt.save_orbax(stored, cfg, tmp_path / "orbax")
    rcfg, restored = ckpt.load_orbax(path)
    assert rcfg == cfg
    assert_trees_bit_equal(stored, restored)
    assert isinstance(restored["layers"][cfg.engram_layer_ids[-1]]["engram"]["embed"].weight, np.ndarray)
    assert_trees_bit_equal(stored, ckpt.load_checkpoint(path)[1])  # detected by load_checkpoint too


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_variant_for_bf16_f32_readers(cfg, params, tmp_path, dtype):
    path = ckpt.save_checkpoint(params, cfg, tmp_path / "dense", dense_dtype=dtype, n_shards=2)
    with open(os.path.join(path, "config.json")) as f:
        assert "quantization_config" not in json.load(f)
    want = {"float32": {"F32"}, "bfloat16": {"BF16", "F32"}}[dtype]
    table = _header_table(path)
    assert {dt for dt, _ in table.values()} == want  # no FP8, FP4 or UE8M0 left
    assert table["layers.0.ffn.experts.3.w1.weight"] == (ckpt._DENSE_DTYPES[dtype], (128, 256))
    lcfg, dense = ckpt.load_checkpoint(path)
    assert lcfg.dtype == "bf16"
    ref = _dequantize(params, dtype)
    for (p, x), y in zip(jax.tree_util.tree_leaves_with_path(ref, is_leaf=is_weight_leaf),
                         jax.tree_util.tree_leaves(dense, is_leaf=is_weight_leaf)):
        if isinstance(x, quant.Fp8Rows):  # re-quantized on load: same values, scale bytes may differ
            assert np.array_equal(np.asarray(x.dequantize()), np.asarray(y.dequantize())), jax.tree_util.keystr(p)
        else:
            assert np.array_equal(_bytes(x), _bytes(y)), jax.tree_util.keystr(p)


def test_hf_layout_loads_exactly_converted(cfg, params, tmp_path):
    path = ckpt.save_checkpoint(params, cfg, tmp_path / "hf", hf_layout=True, n_shards=3)
    table = _header_table(path)
    assert table["layers.0.attn.wo_a.weight"] == ("F8_E4M3", (256, 128))
    assert table["layers.0.attn.wo_a.scale"] == ("F8_E8M0", (8, 4))
    assert table["layers.2.attn.compressor.wgate.weight"] == ("BF16", (64, 256))
    assert table == {k: (d, s) for k, d, s in ckpt.release_tensors(cfg, hf_layout=True)}
    _, loaded = ckpt.load_checkpoint(path)
    attn, got = params["layers"][2]["attn"], loaded["layers"][2]["attn"]
    wo_a = quant.quantize_fp8_weight(attn["wo_a"]).dequantize(jnp.bfloat16)
    assert got["wo_a"].dtype == jnp.bfloat16 and np.array_equal(_bytes(wo_a), _bytes(got["wo_a"]))
    assert got["compressor"]["wgate"].dtype == jnp.bfloat16
    assert np.array_equal(_bytes(attn["compressor"]["wgate"]), _bytes(got["compressor"]["wgate"]))


# ---- the written format -------------------------------------------------------------------------------------


def test_release_names_dtypes_and_index(cfg, ckpt_dir):
    table = _header_table(ckpt_dir)
    D, Q, E, F = cfg.dim, cfg.q_lora_rank, cfg.n_routed_experts, cfg.moe_inter_dim
    HD = cfg.n_heads * cfg.head_dim
    # spec §5 rows present in the tiny config (tiny layers: 2 = ratio-2 KV source, 4 = ratio-1 source,
    # 6 = reindex, 1 and 3 = Engram)
    expect = {
        "embed.weight": ("BF16", (cfg.vocab_size, D)),
        "head.weight": ("BF16", (cfg.vocab_size, D)),
        "norm.weight": ("BF16", (D,)),
        "layers.0.attn_norm.weight": ("BF16", (D,)),
        "layers.0.hc_attn_fn": ("F32", (24, 4 * D)),
        "layers.0.hc_ffn_base": ("F32", (24,)),
        "layers.0.hc_ffn_scale": ("F32", (3,)),
        "layers.0.attn.wq_a.weight": ("F8_E4M3", (Q, D)),
        "layers.0.attn.wq_a.scale": ("F8_E8M0", (Q // 32, D // 32)),
        "layers.0.attn.q_norm.weight": ("BF16", (Q,)),
        "layers.0.attn.wq_b.weight": ("F8_E4M3", (HD, Q)),
        "layers.0.attn.wq_b.scale": ("F8_E8M0", (HD // 32, Q // 32)),
        "layers.0.attn.wkv.scale": ("F8_E8M0", (cfg.head_dim // 32, D // 32)),
        "layers.0.attn.wo_a.weight": ("BF16", (cfg.o_groups * cfg.o_lora_rank, HD // cfg.o_groups)),
        "layers.0.attn.wo_b.scale": ("F8_E8M0", (D // 32, cfg.o_groups * cfg.o_lora_rank // 32)),
        "layers.0.attn.attn_sink": ("F32", (cfg.n_heads,)),
        "layers.2.attn.compressor.wkv.weight": ("BF16", (cfg.head_dim, D)),
        "layers.2.attn.compressor.wgate.weight": ("BF16", (cfg.head_dim, D)),
        "layers.4.attn.compressor.wkv.weight": ("BF16", (cfg.head_dim, D)),
        "layers.2.attn.indexer.wq_b.scale": ("F8_E8M0", (cfg.index_n_heads * cfg.index_head_dim // 32, Q // 32)),
        "layers.6.attn.indexer.weights_proj.weight": ("BF16", (cfg.index_n_heads, D)),
        "layers.2.attn.indexer.wk.weight": ("BF16", (cfg.index_head_dim, cfg.head_dim)),
        "layers.0.ffn.gate.weight": ("BF16", (E, D)),
        "layers.0.ffn.gate.bias": ("F32", (E,)),
        "layers.0.ffn.gate.bias_vl": ("F32", (E,)),
        "layers.0.ffn.experts.0.w1.weight": ("I8", (F, D // 2)),
        "layers.0.ffn.experts.0.w1.scale": ("F8_E8M0", (F, D // 32)),
        f"layers.{cfg.n_layers - 1}.ffn.experts.{E - 1}.w2.weight": ("I8", (D, F // 2)),
        f"layers.{cfg.n_layers - 1}.ffn.experts.{E - 1}.w2.scale": ("F8_E8M0", (D, F // 32)),
        "layers.0.ffn.shared_experts.w2.scale": ("F8_E8M0", (D // 32, F // 32)),
        "layers.1.engram.embed.weight": ("F8_E4M3", (cfg.engram_num_embeddings[0], cfg.engram_head_dim)),
        "layers.1.engram.embed.scale": ("F8_E8M0", (cfg.engram_num_embeddings[0], cfg.engram_head_dim // 32)),
        "layers.3.engram.wkv.weight": ("F8_E4M3", (D * 5, cfg.engram_n_cols * cfg.engram_head_dim)),
        "layers.1.engram.q_weight": ("BF16", (cfg.hc_mult, D)),
    }
    for key, want in expect.items():
        assert table.get(key) == want, key
    assert table == {k: (d, s) for k, d, s in ckpt.release_tensors(cfg)}
    assert not any(k.startswith("model.") or "tid2eid" in k or "hc_head" in k for k in table)
    # the DSpark stages (spec §5 rows mtp.*), each a window-only block with its own experts
    R, ED = cfg.dspark_markov_rank, cfg.dspark_n_routed_experts
    last = cfg.n_mtp_layers - 1
    assert table["mtp.0.main_proj.weight"] == ("F8_E4M3", (D, len(cfg.dspark_target_layer_ids) * D))
    assert table["mtp.0.main_norm.weight"] == ("BF16", (D,))
    assert table[f"mtp.{last}.markov_head.embed.weight"] == ("BF16", (cfg.vocab_size, R))
    assert table[f"mtp.{last}.confidence_head.proj.weight"] == ("BF16", (1, D + R))
    assert table[f"mtp.{last}.ffn.experts.{ED - 1}.w1.weight"] == ("I8", (F, D // 2))
    assert "mtp.1.attn.compressor.wkv.weight" not in table and "mtp.1.main_proj.weight" not in table

    with open(os.path.join(ckpt_dir, ckpt.INDEX_NAME)) as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(table)
    assert index["metadata"]["total_size"] == sum(math.prod(s) * st.ITEMSIZE[d] for d, s in table.values())
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        hf = json.load(f)
    assert hf["quantization_config"]["weight_block_size"] == [32, 32]
    assert hf["text_config"]["num_hidden_layers"] == cfg.n_layers
    assert sorted(f for f in os.listdir(ckpt_dir) if f.endswith(".safetensors")) == \
        [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    for name in ckpt.TOKENIZER_FILES:
        assert os.path.exists(os.path.join(ckpt_dir, name))


def test_files_parse_with_the_safetensors_library(ckpt_dir):
    safetensors = pytest.importorskip("safetensors")
    with safetensors.safe_open(os.path.join(ckpt_dir, "model-00001-of-00004.safetensors"), "numpy") as f:
        assert f.metadata() == {"format": "pt"}
        assert "layers.0.attn.attn_sink" in set(f.keys())
        np.testing.assert_array_equal(f.get_tensor("layers.0.attn.attn_sink"),
                                      st.open_file(os.path.join(ckpt_dir, "model-00001-of-00004.safetensors"))
                                      .array("layers.0.attn.attn_sink"))


def test_flash_release_shapes_without_allocating():
    cfg = preset("flash")
    a = abstract_params(cfg)
    attn, ffn = a["layers"][0]["attn"], a["layers"][0]["ffn"]
    assert attn["wq_b"].weight.shape == (32768, 1280) and attn["wq_b"].scale.shape == (1024, 40)
    assert attn["wq_a"].scale.shape == (40, 160) and attn["wkv"].scale.shape == (16, 160)
    assert attn["wo_a"].shape == (8192, 4096) and attn["wo_b"].scale.shape == (160, 256)
    assert ffn["experts"]["w1"].weight.shape == (384, 2304, 2560)
    assert ffn["experts"]["w1"].scale.shape == (384, 2304, 160)
    assert ffn["experts"]["w2"].weight.shape == (384, 5120, 1152)
    assert ffn["experts"]["w2"].scale.shape == (384, 5120, 72)
    assert a["layers"][1]["engram"]["embed"].scale.shape == (384006168, 8)
    assert a["layers"][1]["engram"]["wkv"].scale.shape == (800, 192)

    table = {k: (d, s) for k, d, s in ckpt.release_tensors(cfg, hf_layout=True)}
    assert table["layers.7.ffn.experts.383.w1.weight"] == ("I8", (2304, 2560))
    assert table["layers.7.ffn.experts.383.w2.scale"] == ("F8_E8M0", (5120, 72))
    assert table["layers.3.attn.wo_a.scale"] == ("F8_E8M0", (256, 128))
    totals = collections.Counter()
    for d, s in table.values():
        totals[d] += math.prod(s) * st.ITEMSIZE[d]
    # spec §5 totals, the DSpark stages included (main + DSpark experts are all the I8)
    assert totals["I8"] == 278_585_671_680  # "I8 278.6 GB"
    assert totals["F32"] == 169_229_128  # "F32 169.2 MB"
    assert round(totals["F8_E4M3"] / 1e9, 1) == 204.0 and round(totals["F8_E8M0"] / 1e9, 1) == 23.6
    assert table["mtp.0.main_proj.weight"] == ("F8_E4M3", (5120, 15360))
    assert table["mtp.2.markov_head.head.weight"] == ("BF16", (129280, 256))
    assert table["mtp.2.confidence_head.proj.weight"] == ("BF16", (1, 5376))
    assert table["mtp.1.ffn.experts.127.w2.weight"] == ("I8", (5120, 1152)) and "mtp.1.ffn.experts.128.w2.weight" \
        not in table


# ---- validation -----------------------------------------------------------------------------------------------


def _rewrite_shard(path, fn, edit):
    """Rewrites one shard through edit({name: array}) -> {name: (dtype, array)}."""
    mf = st.open_file(os.path.join(path, fn))
    tensors = {k: (t.dtype, np.array(mf.array(k))) for k, t in mf.header.tensors.items()}
    del mf
    tensors = edit(tensors)
    st.write_file(os.path.join(path, fn), [st.TensorOut(k, d, tuple(a.shape), lambda a=a: a)
                                           for k, (d, a) in tensors.items()], {"format": "pt"})


def _shard_of(path, key):
    with open(os.path.join(path, ckpt.INDEX_NAME)) as f:
        return json.load(f)["weight_map"][key]


def _drop(key):
    def edit(t):
        del t[key]
        return t
    return edit


def _change(key, dtype=None, shape_fn=None):
    def edit(t):
        d, a = t[key]
        if dtype == "F32":
            d, a = "F32", a.astype(np.float32)
        if shape_fn:
            a = shape_fn(a)
        t[key] = (d, a)
        return t
    return edit


def _corrupt(kind, path):
    """Applies one corruption; returns strings the error must name (tensor, file)."""
    if kind == "missing shard":
        fn = "model-00002-of-00004.safetensors"
        os.remove(os.path.join(path, fn))
        return [fn, "layers."]
    if kind == "truncated shard":
        fn = "model-00003-of-00004.safetensors"
        last = max(st.read_header(os.path.join(path, fn)).tensors.values(), key=lambda t: t.end)
        with open(os.path.join(path, fn), "r+b") as f:
            f.truncate(last.end - 10)
        return [fn, last.name, "truncated"]
    if kind == "wrong dtype":
        key = "layers.3.attn_norm.weight"
        _rewrite_shard(path, _shard_of(path, key), _change(key, dtype="F32"))
        return [key, _shard_of(path, key), "F32", "BF16"]
    if kind == "wrong shape":
        key = "layers.5.attn.wq_a.scale"
        _rewrite_shard(path, _shard_of(path, key), _change(key, shape_fn=lambda a: a[:-1]))
        return [key, _shard_of(path, key), "shape"]
    if kind == "missing key":
        key = "layers.3.ffn.experts.5.w2.scale"
        _rewrite_shard(path, _shard_of(path, key), _drop(key))
        return [key, _shard_of(path, key), "missing"]
    if kind == "unexpected key":
        key, fn = "layers.0.attn.bogus.weight", "model-00001-of-00004.safetensors"
        _rewrite_shard(path, fn, lambda t: {**t, key: ("BF16", np.zeros((4,), jnp.bfloat16))})
        return [key, fn, "unexpected"]
    if kind == "config n_layers":
        with open(os.path.join(path, "config.json")) as f:
            d = json.load(f)
        last = d["text_config"]["num_hidden_layers"] - 1
        d["text_config"]["num_hidden_layers"] = last
        d["text_config"]["num_nextn_predict_layers"] = 0  # DSpark taps the last layers: a prefix has no stages
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(d, f)
        return [f"layers.{last}.", _shard_of(path, f"layers.{last}.attn_norm.weight"), f"n_layers={last}"]
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["missing shard", "truncated shard", "wrong dtype", "wrong shape", "missing key",
                                  "unexpected key", "config n_layers"])
def test_corruption_is_named(ckpt_dir, tmp_path, kind):
    path = str(tmp_path / "bad")
    shutil.copytree(ckpt_dir, path)
    must_name = _corrupt(kind, path)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load_checkpoint(path)
    msg = str(e.value)
    for s in must_name:
        assert s in msg, (s, msg)
    assert "nothing was loaded" in msg


def test_config_disagreeing_with_cfg_argument(cfg, ckpt_dir):
    with pytest.raises(ckpt.CheckpointError, match="n_routed_experts"):
        ckpt.load_checkpoint(ckpt_dir, cfg.replace(n_routed_experts=16, n_activated_experts=2))


def test_unmodelled_dspark_stages_and_vision_are_skipped_with_one_log_line(ckpt_dir, stored, tmp_path, caplog):
    """DSpark stages past the config's n_mtp_layers are skipped; the vision tower's tensors are skipped under a
    text-only config.json."""
    path = str(tmp_path / "extra")
    shutil.copytree(ckpt_dir, path)
    extra = {"mtp.5.main_norm.weight": ("BF16", np.ones((8,), jnp.bfloat16)),  # stages past the config's
             "mtp.6.markov_head.embed.weight": ("BF16", np.ones((4, 8), jnp.bfloat16))}
    _rewrite_shard(path, "model-00004-of-00004.safetensors", lambda t: {**t, **extra})
    with open(os.path.join(path, "config.json")) as f:
        conf = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**conf, "vision_config": {"num_hidden_layers": 0}}, f)
    with caplog.at_level(logging.INFO, logger="dsv41.checkpoint"):
        cfg, params = ckpt.load_checkpoint(path)
    assert cfg.vision is None
    text_only = {k: v for k, v in stored.items() if k not in ("vision", "aligner") and not k.startswith("image_")}
    assert_trees_bit_equal(text_only, params)
    n_vision = len(jax.tree_util.tree_leaves(stored["vision"]))
    lines = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(lines) == 1 and "mtp.* 2" in lines[0] and f"vision.* {n_vision}" in lines[0], lines
    assert "aligner.* 4" in lines[0] and "image_* 3" in lines[0], lines


def test_refuses_what_cannot_fit():
    class Dev:
        id = 0

        def memory_stats(self):
            return {"bytes_limit": 10 << 30, "bytes_in_use": 4 << 30}

    ckpt.check_fits({Dev(): 5 << 30}, "ok")
    with pytest.raises(ckpt.CheckpointError, match="needs 7.52 GB .* only 6.44 GB"):
        ckpt.check_fits({Dev(): 7 << 30}, "loading x")


def test_sharded_load_on_a_two_device_mesh(ckpt_dir):
    """Per-shard reads: experts split over the data ranks (DEP), rows and columns over a 'tensor' axis (separate
    process: the CPU device count is fixed when jax starts)."""
    code = textwrap.dedent(f"""
        import numpy as np, jax
        from dsv41 import checkpoint as ckpt, sharding
        _, ref = ckpt.load_checkpoint({str(ckpt_dir)!r}, progress=False)
        for shape, mode in (((2, 1), "pread"), ((1, 2), "pread"), ((2, 1), "mmap")):
            mesh = sharding.make_mesh(sharding.Parallelism(data=shape[0], tensor=shape[1], expert=shape[0] > 1))
            _, sh = ckpt.load_checkpoint({str(ckpt_dir)!r}, mesh=mesh, progress=False, read_mode=mode)
            w1 = sh["layers"][0]["ffn"]["experts"]["w1"]
            assert w1.weight.sharding.spec[:2] == w1.scale.sharding.spec[:2], w1.weight.sharding
            axis = 0 if shape[0] == 2 else 1  # experts over 'data', or the ffn dim over 'tensor'
            assert w1.weight.sharding.spec[axis] == ("data", "tensor")[axis]
            assert w1.weight.addressable_shards[0].data.shape[axis] == w1.weight.shape[axis] // 2
            if shape[1] == 2:  # a column shard: wo_b is (embed, heads)
                assert sh["layers"][0]["attn"]["wo_b"].weight.sharding.spec[1] == "tensor"
                assert sh["embed"].sharding.spec[0] == "tensor"
            for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(sh)):
                assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
        print("OK")
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(ckpt.__file__)))
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


def test_forward_on_loaded_checkpoint_equals_written_params(tmp_path):
    from dsv41.tokenizer import BUILTIN_DIR

    cfg = preset("tiny")
    params = init_params(cfg, seed=1)
    path = ckpt.save_checkpoint(params, cfg, tmp_path / "fwd", tokenizer_dir=BUILTIN_DIR, n_shards=3)
    cfg2, loaded = ckpt.load_checkpoint(path)
    assert cfg2 == cfg
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40)).astype(np.int32)
    # the written values placed as the loader places its arrays (device arrays committed to a device, Engram
    # tables in host memory): one forward program for both sides (a CPU compile of ~15 s), not one per placement
    written = jax.tree.map(lambda w, r: np.asarray(w) if isinstance(r, np.ndarray) else jax.device_put(w, r.sharding),
                           params, weights(loaded))
    logits = model.forward(loaded, cfg, ids)
    # the public API's shapes (checked here rather than in a forward of its own: a ~15 s compile on CI)
    assert logits.shape == (2, 40, cfg.vocab_size) and logits.dtype == jnp.float32
    assert bool(jnp.isfinite(logits).all())
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(model.forward(written, cfg, ids)))
