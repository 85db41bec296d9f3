import jax.numpy as jnp
import numpy as np
import pytest

from dsv41 import forward, init_params, quant
from dsv41 import params as P
from dsv41.config import preset
from dsv41.model import InputError


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    return cfg, init_params(cfg, seed=0)


@pytest.fixture(scope="module")
def exact150(tiny):
    """(float32 parameters, 301 ids, the logits of their first 150 under quant.EXACT_F32): one forward program
    (a CPU compile of several seconds) for the two tests below, which share an xdist group so that it runs once."""
    cfg, params = tiny
    pf = P.dequantize_params(params, "float32")
    ids = np.random.default_rng(1).integers(3, cfg.vocab_size, (1, 301)).astype(np.int32)
    return pf, ids, np.asarray(forward(pf, cfg, ids[:, :150], quant.EXACT_F32))


@pytest.mark.xdist_group("model_exact150")
def test_causal_across_the_window_float32(tiny, exact150):
    """Row i depends only on tokens <= i: a 150-token prefix equals the first rows of a 301-token run."""
    cfg, _ = tiny
    pf, ids, part = exact150
    full = np.asarray(forward(pf, cfg, ids, quant.EXACT_F32))
    np.testing.assert_allclose(part, full[:, :150], rtol=0, atol=2e-5)
    assert np.abs(full[:, 150:] - full[:, 149:-1]).max() > 1e-2  # and later rows do change


@pytest.mark.xdist_group("model_exact150")
def test_numerics_switches_matter(tiny, exact150):
    cfg, _ = tiny
    pf, ids, exact = exact150
    kvq = np.asarray(forward(pf, cfg, ids[:, :150], quant.Numerics(act_quant=False, bf16_probs=False,
                                                                   dtype="float32")))
    assert 1e-4 < np.abs(exact - kvq).max()


@pytest.mark.parametrize("ids, msg", [
    (np.array([[1, 2, 5000]]), "outside the vocabulary"),
    (np.array([[1, -1]]), "outside the vocabulary"),
    (np.zeros((1, 0), np.int32), "empty"),
    (np.zeros((2, 2, 2), np.int32), r"\[batch, seq\]"),
    (np.array([[0.5, 1.0]]), "integers"),
])
def test_bad_input_is_rejected_before_tracing(tiny, ids, msg):
    cfg, params = tiny
    with pytest.raises(InputError, match=msg):
        forward(params, cfg, ids)


def test_abstract_shapes_match_release():
    ab = P.abstract_params(preset("flash"))
    a = ab["layers"][20]["attn"]
    assert a["wq_b"].weight.shape == (32768, 1280) and a["wq_b"].scale.shape == (1024, 40)
    e = ab["layers"][3]["ffn"]["experts"]
    assert e["w1"].weight.shape == (384, 2304, 2560) and e["w1"].scale.shape == (384, 2304, 160)
    assert e["w2"].weight.shape == (384, 5120, 1152) and e["w2"].scale.shape == (384, 5120, 72)
    assert ab["layers"][1]["engram"]["embed"].weight.shape == (384006168, 256)


@pytest.mark.parametrize("wfmt", ["bf16", "fp8", "f32"])
def test_linear_f32_is_a_float32_product(wfmt):
    """nn.linear_f32 (router, compressor pooling, head): three exact bf16 terms of x against a bf16-exact
    weight must be as close to the float64 product as a float32 GEMM is; a float32 weight takes the float32
    GEMM."""
    import jax

    from dsv41 import nn
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((7, 512)) * 5, jnp.float32)
    w32 = jnp.asarray(rng.standard_normal((96, 512)) * 0.05, jnp.float32)
    w = {"bf16": w32.astype(jnp.bfloat16), "fp8": quant.quantize_fp8_weight(w32), "f32": w32}[wfmt]
    wd = np.asarray(quant.dense(w, jnp.float32), np.float64)
    want = np.asarray(x, np.float64) @ wd.T
    y = np.asarray(jax.jit(nn.linear_f32)(x, w))
    f32 = np.asarray(jnp.einsum("ti,oi->to", x, jnp.asarray(wd, jnp.float32), precision=jax.lax.Precision.HIGHEST))
    bound = max(4 * np.abs(f32 - want).max(), 1e-6 * np.abs(want).max())
    assert y.dtype == np.float32 and np.abs(y - want).max() <= bound


def test_mhc_coefficients_of_a_bf16_stream_are_float32_dots(monkeypatch):
    """A bf16 stream's 24 mix dots run as three exact bf16 terms of fn (nn.linear_f32 with the roles swapped):
    the mix values must be as close to float64 as the float32 HIGHEST einsum of the float32 path."""
    from dsv41 import mhc
    cfg = preset("tiny")
    hc, d = cfg.hc_mult, 384
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 3, hc, d)) * 3, jnp.bfloat16)
    fn = jnp.asarray(rng.standard_normal(((2 + hc) * hc, hc * d)) * 0.02, jnp.float32)
    scale, base = jnp.ones(3, jnp.float32), jnp.zeros(((2 + hc) * hc,), jnp.float32)
    mixes = []  # the mix values each path hands to the coefficient formulas
    monkeypatch.setattr(mhc, "coefficients_from_mix", lambda m, *a: mixes.append(np.asarray(m, np.float64)))
    mhc.coefficients(x, fn, scale, base, cfg)
    mhc.coefficients(x.astype(jnp.float32), fn, scale, base, cfg)
    m_bf16, m_f32 = mixes
    xf = np.asarray(x.astype(jnp.float32), np.float64).reshape(2, 3, -1)
    want = (xf @ np.asarray(fn, np.float64).T) / np.sqrt((xf * xf).mean(-1, keepdims=True) + cfg.norm_eps)
    bound = max(4 * np.abs(m_f32 - want).max(), 1e-6 * np.abs(want).max())
    assert m_bf16.shape == want.shape and np.abs(m_bf16 - want).max() <= bound


def test_sinkhorn_is_straight_line_code_on_a_gpu():
    """The mHC coefficients lowered for CUDA hold no loop (a while loop launched ~60 kernels a site on the H200);
    for the CPU they keep it (a quarter of the HLO to compile). The two forms agree to float32 roundings."""
    import jax

    from dsv41 import mhc
    cfg = preset("tiny")
    hc, d = cfg.hc_mult, 128
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 7, hc, d)) * 3, jnp.bfloat16)
    fn = jnp.asarray(rng.standard_normal(((2 + hc) * hc, hc * d)) * 0.3, jnp.float32)
    scale, base = jnp.asarray([1.0, 1.0, 2.0]), jnp.asarray(rng.standard_normal((2 + hc) * hc), jnp.float32)
    traced = jax.jit(lambda *a: mhc.coefficients(*a, cfg)).trace(x, fn, scale, base)
    loops = {p: traced.lower(lowering_platforms=(p,)).as_text().count("stablehlo.while") for p in ("cuda", "cpu")}
    assert loops == {"cuda": 0, "cpu": 1}
    comb = jnp.asarray(rng.random((3, hc, hc)) * 5, jnp.float32)
    loop, flat = (jax.jit(lambda c, u=u: mhc.sinkhorn(c, cfg.hc_sinkhorn_iters - 1, cfg.hc_eps, u))(comb)
                  for u in (False, True))
    np.testing.assert_allclose(np.asarray(flat), np.asarray(loop), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(flat).sum(-2), 1.0, atol=1e-3)  # doubly stochastic, up to eps


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_index_scores_in_entry_blocks_equal_one_pass(dtype, monkeypatch):
    """Past `indexer.MAX_PRODUCT_BYTES` of [B, S, heads, G] products the entries are scored in blocks (a long
    prefill on the XLA path); every score is the one a single pass gives, the ragged last block too: bit for bit
    in bf16 (each step rounded), to float32 summation order in float32 (XLA blocks the dot per shape)."""
    import jax

    from dsv41 import indexer

    rng = np.random.default_rng(0)
    B, S, IH, ID, G = 2, 5, 4, 32, 300
    q = jnp.asarray(rng.standard_normal((B, S, IH, ID)), dtype)
    w = jnp.asarray(rng.standard_normal((B, S, IH)), dtype)
    k = jnp.asarray(rng.standard_normal((B, G, ID)), dtype)
    # a fresh function a trace: traces do not key on the module constant (and clearing jax's caches would make
    # every later test in this worker compile its programs again)
    one = jax.jit(lambda *a: indexer.raw_scores(*a, dtype))(q, w, k)
    monkeypatch.setattr(indexer, "MAX_PRODUCT_BYTES", 4 * B * S * IH * 128)  # blocks of 128: 3, the last ragged
    blocked = jax.jit(lambda *a: indexer.raw_scores(*a, dtype))(q, w, k)
    assert blocked.shape == (B, S, G)
    if dtype == jnp.bfloat16:
        np.testing.assert_array_equal(np.asarray(blocked), np.asarray(one))
    else:
        np.testing.assert_allclose(np.asarray(blocked), np.asarray(one), rtol=0, atol=1e-5 * np.abs(one).max())


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_index_products_written_in_the_activation_dtype_are_the_same_scores(dtype, monkeypatch):
    """`raw_scores(..., products_in_dtype=True)`: the q.k GEMM stores its products in the activation dtype (the
    one rounding of its float32 accumulator) instead of float32 rounded by the next op: the same scores bit for
    bit, in one pass and in blocks (whose size it computes from the smaller products)."""
    import jax

    from dsv41 import indexer

    rng = np.random.default_rng(1)
    B, S, IH, ID, G = 2, 9, 8, 64, 700
    q = jnp.asarray(rng.standard_normal((B, S, IH, ID)), dtype)
    w = jnp.asarray(rng.standard_normal((B, S, IH)), dtype)
    k = jnp.asarray(rng.standard_normal((B, G, ID)), dtype)
    def f(in_dtype: bool):  # a fresh function a trace: traces do not key on the module constant
        return jax.jit(lambda *a: indexer.raw_scores(*a, dtype, in_dtype))(q, w, k)

    today = f(False)
    np.testing.assert_array_equal(np.asarray(f(True)), np.asarray(today))
    item = jnp.dtype(dtype).itemsize
    monkeypatch.setattr(indexer, "MAX_PRODUCT_BYTES", item * B * S * IH * 256)  # blocks of 256: 3, ragged
    blocked = f(True)
    if dtype == jnp.bfloat16:
        np.testing.assert_array_equal(np.asarray(blocked), np.asarray(today))
    else:
        np.testing.assert_allclose(np.asarray(blocked), np.asarray(today), rtol=0, atol=1e-5 * np.abs(today).max())
