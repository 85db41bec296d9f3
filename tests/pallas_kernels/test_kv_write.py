"""Tests of the fused decode KV writes (pallas_kernels/kv_write.py).

1. The plain-jnp reference equals what serving/engine/programs.py's cached_attention writes at T=1 (tiny preset,
   one layer of each kind: SWA-only, FULL ratio 2, FULL ratio 1 with its doubled split-layer ring).
2. The kernel, in the Mosaic GPU interpreter, writes exactly the reference's bytes into poisoned pools (random
   bytes everywhere: any stray or missing write shows), with padding rows, idle slots, groups completing or
   not, write_lo blocking, a block-table entry past the pool, entry ids past the table; at test widths (rows
   under 16 B take the scalar path) and at Flash widths (TMA bulk path).
3. The Pallas -> Mosaic GPU lowering for sm_90a at Flash shapes, with every pool array aliased in place.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41 import attention as A
from dsv41 import compressor, model, quant, rope
from dsv41.config import ModelConfig, preset
from dsv41.layer_plan import Carry
from pallas_kernels import kv_write as kw
from host_arrays import put

gpu = pytest.mark.gpu
FLASH = ModelConfig()
FIELDS = [f.name for f in dataclasses.fields(kw.LayerKV)]


def _bytes(x):
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x


def _u8(rng, shape, dtype=jnp.uint8):
    a = rng.integers(0, 256, shape, dtype=np.uint8)
    return put(a if dtype == jnp.uint8 else a.view(dtype))  # the bitcast on the host: no compile


def make_case(ratio, seed, *, Dh=64, ID=32, S=8, R=8, P=34, E=4, C=3, rope_dim=16):
    """Poisoned layer pools and a batch of B = 10 rows covering the edge cases. Pages are distinct per row
    (P >= B * C), so no two rows share a destination."""
    rng = np.random.default_rng(seed)
    lkv = kw.LayerKV(swa_q=_u8(rng, (S, R, Dh), jnp.float8_e4m3fn), swa_s=_u8(rng, (S, R, Dh // 32)))
    if ratio:
        lkv = dataclasses.replace(
            lkv, kv_packed=_u8(rng, (P, E, Dh // 2)), kv_scale=_u8(rng, (P, E, Dh // 16), jnp.float8_e4m3fn),
            ik_packed=_u8(rng, (P, E, ID // 2)), ik_scale=_u8(rng, (P, E, ID // 32)),
            comp_state=put(rng.standard_normal((S, 2 * Dh)), jnp.float32) if ratio == 2 else None)
    r = max(ratio, 1)
    span = C * E * r  # positions the block table covers
    B = 10
    slot = np.array([0, 1, 2, S, 3, 4, 5, S, 6, 7], np.int32)  # rows 3, 7: padding (slot == S)
    n_valid = np.array([1, 1, 1, 0, 0, 1, 1, 0, 1, 1], np.int32)  # row 4: a real slot with no token
    pos = rng.integers(0, span, B).astype(np.int32)
    pos[0] = 2 * rng.integers(0, span // 2) + 1  # odd: completes a ratio-2 group
    pos[1] = 2 * rng.integers(0, span // 2)  # even: opens one
    pos[2] = 2 * rng.integers(1, span // 2) + 1  # odd, but below write_lo
    pos[5] = span + 2 * rng.integers(0, 4) + 1  # past the block table (column clipped)
    pos[6] = 2 * rng.integers(1, span // 2) + 1  # write_lo exactly at its group start: written
    pos[8] = 2 * rng.integers(0, span // 2) + 1  # its page is unused (block table holds P): dropped
    write_lo = np.zeros(B, np.int32)
    write_lo[2] = pos[2] + 1
    write_lo[6] = (pos[6] // r) * r
    bt = rng.permutation(P)[: B * C].reshape(B, C).astype(np.int32)
    bt[8, min((pos[8] // r) // E, C - 1)] = P
    args = (put(rng.standard_normal((B, Dh)), jnp.bfloat16), put(slot), put(pos), put(n_valid), put(bt),
            put(write_lo))
    extra = {}
    if ratio:
        extra = {
            "comp_kv": put(rng.standard_normal((B, Dh)), jnp.float32 if ratio == 2 else jnp.bfloat16),
            "comp_score": put(rng.standard_normal((B, Dh)), jnp.float32) if ratio == 2 else None,
            "p_comp": {"norm": put(1 + 0.1 * rng.standard_normal(Dh), jnp.bfloat16)},
            "p_idx": {"wk": put(rng.standard_normal((ID, Dh)) / np.sqrt(Dh), jnp.bfloat16),
                   "k_norm": put(1 + 0.1 * rng.standard_normal(ID), jnp.bfloat16)},
            "freqs": (1.0 / 10000 ** (np.arange(0, rope_dim, 2) / rope_dim)).astype(np.float32)}
    return lkv, args, extra


def _run(ratio, lkv, args, extra, backends):
    """One jit for all backends: one compile, the shared XLA prelude compiled once."""
    kc = kw.KVWriteConfig(ratio, 1e-6)
    f = jax.jit(lambda lkv, *a: [kw.kv_write_decode(lkv, *a, kcfg=kc, backend=b, **extra) for b in backends])
    return f(lkv, *args)


def _expected_rows(ratio, lkv, args):
    """Independent python statement of which rows change: {field: set of flat row ids}."""
    _, slot, pos, nv, bt, wlo = (np.asarray(a) for a in args)
    S, R = lkv.swa_q.shape[:2]
    out = {k: set() for k in FIELDS}
    for b in range(len(slot)):
        if not (0 <= slot[b] < S and nv[b] > 0):
            continue
        out["swa_q"].add(slot[b] * R + pos[b] % R)
        if ratio == 2 and pos[b] % 2 == 0:
            out["comp_state"].add(slot[b])
        if ratio:
            P, E = lkv.kv_packed.shape[:2]
            g = pos[b] // ratio
            page = bt[b, min(g // E, bt.shape[1] - 1)]
            if (ratio == 1 or pos[b] % 2 == 1) and g * ratio >= wlo[b] and page < P:
                out["kv_packed"].add(page * E + g % E)
    out["swa_s"] = out["swa_q"]
    for k in ("kv_scale", "ik_packed", "ik_scale"):
        out[k] = out["kv_packed"]
    return out


FLASH_WIDTHS = {"Dh": 512, "ID": 128, "rope_dim": 64, "R": 16, "P": 34, "E": 8, "C": 3}


@pytest.mark.parametrize("ratio,widths", [(0, {}), (2, {}), (1, FLASH_WIDTHS)], ids=["swa", "ratio2", "ratio1-flash"])
def test_kernel_matches_reference_poisoned(ratio, widths):
    """At test widths (Dh=64, ID=32) the 2- and 4-byte scale rows take the scalar path; at Flash widths (Dh=512,
    ID=128) every row but the 4-byte index scales goes through the TMA bulk path."""
    lkv, args, extra = make_case(ratio, seed=10 + ratio, **widths)
    ref, out = _run(ratio, lkv, args, extra, ("xla", "interpret"))
    want = _expected_rows(ratio, lkv, args)
    assert want["swa_q"] and (ratio == 0 or want["kv_packed"])  # the case writes something
    for k in FIELDS:
        if getattr(lkv, k) is None:
            assert getattr(out, k) is None
            continue
        o, r, p = _bytes(getattr(out, k)), _bytes(getattr(ref, k)), _bytes(getattr(lkv, k))
        np.testing.assert_array_equal(o, r, err_msg=k)
        o2, p2 = o.reshape(-1, o.shape[-1]), p.reshape(-1, p.shape[-1])
        changed = {int(i) for i in np.nonzero((o2 != p2).any(-1))[0]}
        assert changed <= want[k], (k, changed, want[k])  # nothing else touched
        if o2.shape[-1] * o2.itemsize >= 16:  # big rows: a random poison row never equals the new bytes
            assert changed == want[k], (k, changed, want[k])


# ---- the reference against the engine's own write path -------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    from serving.engine import kv_pool

    cfg = preset("tiny")
    lay = kv_pool.PoolLayout(num_pages=12, page_tokens=8, num_slots=4)
    pool = jax.jit(kv_pool.allocate, static_argnums=(0, 1))(cfg, lay)  # eagerly: a compile a leaf shape
    rng = np.random.default_rng(0)

    def poison(x):
        if x.dtype == jnp.int32:
            return x
        if x.dtype == jnp.float32:
            return put(rng.standard_normal(x.shape), jnp.float32)
        return _u8(rng, x.shape, x.dtype)

    return cfg, jax.tree_util.tree_map(poison, pool)


def _layer_params(cfg, ratio, rng):
    D, Dh, ID = cfg.dim, cfg.head_dim, cfg.index_head_dim
    w = lambda *s: put(rng.standard_normal(s) / np.sqrt(s[-1]), jnp.bfloat16)
    n = lambda d: put(1 + 0.1 * rng.standard_normal(d), jnp.bfloat16)
    p = {"wkv": w(Dh, D), "kv_norm": n(Dh)}
    if ratio:
        p["compressor"] = {"wkv": w(Dh, D), "norm": n(Dh)}
        if ratio == 2:
            p["compressor"]["wgate"] = w(Dh, D)
        p["indexer"] = {"wk": w(ID, Dh), "k_norm": n(ID)}
    return p


@pytest.mark.parametrize("layer", [0, 2, 4])  # tiny: SWA-only, FULL ratio 2, FULL ratio 1 (the split layer)
def test_reference_equals_programs(tiny, layer):
    from serving.engine import kv_pool, programs

    cfg, pool = tiny
    assert layer in (0, *cfg.kv_source_layers), "the cases are the preset's KV-writing layer kinds"
    num = quant.REFERENCE
    r = cfg.compress_ratios[layer]
    ratio = r if layer in cfg.kv_source_layers else 0
    rng = np.random.default_rng(layer)
    p = _layer_params(cfg, ratio, rng)
    B, S = 4, pool.runs[0].swa_q.shape[0]
    ctx = pool.of_layer(cfg, cfg.kv_source_layers[0]).kv_packed.shape[0] // B
    slot = np.array([2, 0, S, 1], np.int32)
    n_valid = np.array([1, 1, 0, 1], np.int32)
    pos0 = np.array([7, 40, 0, 129], np.int32)  # odd, even, padding, odd (past a 128 window)
    write_lo = np.array([0, 0, 0, 130], np.int32)  # row 3: its group starts at 128 < 130 -> not written
    bt = np.arange(B * ctx, dtype=np.int32).reshape(B, ctx)[::-1].copy()
    b = programs.Batch(tokens=put(np.zeros((B, 1), np.int32)), pos0=put(pos0), n_valid=put(n_valid),
                       slot=put(slot), block_table=put(bt), write_lo=put(write_lo),
                       ring_lo=put(np.zeros((B, cfg.n_layers), np.int32)), rows=[])
    x = put(rng.standard_normal((B, 1, cfg.dim)), jnp.bfloat16)
    freqs = model.freqs_for(cfg)[layer]
    kc = kw.KVWriteConfig(ratio, cfg.norm_eps)

    def both(x, p, pool, b):  # one jit (one CPU compile) for the engine's path, its layer's view, and the reference
        _, want, _ = programs.cached_attention(x, p, layer, cfg, num, pool, b, Carry(), freqs, "kv_only")
        want = kv_pool.ring_view(want.of_layer(cfg, layer), b.slot, 0)[0]
        lkv = kv_pool.ring_view(pool.of_layer(cfg, layer), b.slot, 0)[0]  # (the case layers are runs of one)
        extra = {}
        if ratio:
            ck, cs = compressor.project(x, p["compressor"], ratio, num)
            extra = {"comp_kv": ck[:, 0], "comp_score": None if cs is None else cs[:, 0], "p_comp": p["compressor"],
                         "p_idx": p["indexer"], "freqs": freqs}
        swa_kv = A.window_kv(x, p, b.pos0[:, None], freqs, cfg, num)[:, 0]
        got = kw.kv_write_reference(lkv, swa_kv, b.slot, b.pos0, b.n_valid, b.block_table, b.write_lo, kcfg=kc,
                                    num=num, **extra)
        return want, got, lkv

    want, got, lkv = jax.jit(both)(x, p, pool, b)
    pairs = [(k, getattr(want, k)) for k in ("swa_q", "swa_s")]
    if ratio:
        pairs += [(k, getattr(want, k)) for k in ("kv_packed", "kv_scale", "ik_packed", "ik_scale")]
        if ratio == 2:
            pairs.append(("comp_state", want.comp_state))
    n_changed = 0
    for k, w in pairs:
        np.testing.assert_array_equal(_bytes(getattr(got, k)), _bytes(w), err_msg=k)
        n_changed += int((_bytes(w) != _bytes(getattr(lkv, k))).sum())
    assert n_changed > 0


# ---- lowering for the H200 -------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio,layer", [(0, 0), (2, 2), (1, 20)])
def test_lowers_for_sm90a_at_flash_shapes(ratio, layer):
    sd = jax.ShapeDtypeStruct
    Dh, ID = FLASH.head_dim, FLASH.index_head_dim
    B, S, R, P, C = 64, 64, 2 * FLASH.window_size, 512, 64
    E = 64 // max(ratio, 1)
    lkv = kw.LayerKV(sd((S, R, Dh), jnp.float8_e4m3fn), sd((S, R, Dh // 32), jnp.uint8))
    extra = {}
    if ratio:
        lkv = dataclasses.replace(
            lkv, kv_packed=sd((P, E, Dh // 2), jnp.uint8), kv_scale=sd((P, E, Dh // 16), jnp.float8_e4m3fn),
            ik_packed=sd((P, E, ID // 2), jnp.uint8), ik_scale=sd((P, E, ID // 32), jnp.uint8),
            comp_state=sd((S, 2 * Dh), jnp.float32) if ratio == 2 else None)
        extra = {"comp_kv": sd((B, Dh), jnp.float32 if ratio == 2 else jnp.bfloat16),
                     "comp_score": sd((B, Dh), jnp.float32) if ratio == 2 else None,
                     "p_comp": {"norm": sd((Dh,), jnp.bfloat16)},
                     "p_idx": {"wk": sd((ID, Dh), jnp.bfloat16), "k_norm": sd((ID,), jnp.bfloat16)}}
    kc = kw.KVWriteConfig(ratio, FLASH.norm_eps)
    freqs = rope.inv_freq(FLASH, layer)

    def f(lkv, x, s, p, n, bt, w, ex):
        return kw.kv_write_decode(lkv, x, s, p, n, bt, w, kcfg=kc, freqs=freqs, backend="pallas", **ex)

    i = sd((B,), jnp.int32)
    txt = jax.jit(f, donate_argnums=0).trace(lkv, sd((B, Dh), jnp.bfloat16), i, i, i, sd((B, C), jnp.int32), i,
                                             extra).lower(lowering_platforms=("cuda",)).as_text()
    n_arrays = sum(x is not None for x in jax.tree_util.tree_leaves(lkv))
    assert txt.count("@mosaic_gpu") == 1
    assert txt.count("output_operand_alias<") == n_arrays  # every pool array updated in place
    assert txt.count("tf.aliasing_output") == n_arrays


# ---- on the GPU ----------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("ratio", [0, 2, 1])
def test_gpu_flash_widths_bitexact(ratio):
    lkv, args, extra = make_case(ratio, seed=5, Dh=512, ID=128, rope_dim=64, R=128, P=64, E=32, C=4)
    ref, out = _run(ratio, lkv, args, extra, ("xla", "pallas"))
    for k in FIELDS:
        if getattr(lkv, k) is not None:
            np.testing.assert_array_equal(_bytes(getattr(out, k)), _bytes(getattr(ref, k)), err_msg=k)
