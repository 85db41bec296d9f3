"""Tests of the fused sparse MQA decode attention (pallas_kernels/sparse_attention).

CPU tests run the Mosaic GPU kernel in the Mosaic GPU interpreter at small
shapes (D=128, small W/K) against the plain-jnp reference, with fresh random
data, ragged validity (rows with no valid key, -1 indices) and both consumer
modes.  Note: in interpret mode the producer's PTX dequant (inline_mgpu) is
replaced by an equivalent per-row jnp dequant; the PTX path is checked
bit-exactly by the numpy emulation test below and on the GPU (gpu tests and
scripts/bench_sparse_attention.py).
"""

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import sparse_attention as sa

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.gpu
skip_no_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def _one_program(f, args, kw):
  """f(*args, **kw) as one jitted program: array arguments traced, the rest static. Eagerly, the wrappers'
  and references' array preparation is dozens of small programs, each an XLA compile (~40 ms on the CPU):
  half of this file's time."""
  arrays = {n: v for n, v in kw.items() if isinstance(v, (jax.Array, np.ndarray))}
  static = tuple(sorted((n, v) for n, v in kw.items() if n not in arrays))
  # blocked: an interpreter call started while an earlier program still runs can starve XLA's CPU thread pool
  # (the Mosaic GPU interpreter's threads run programs that wait on each other): a hang
  return jax.block_until_ready(_program(f, static, args, arrays))


@functools.partial(jax.jit, static_argnums=(0, 1))  # cached by f and the static arguments: a repeat compiles nothing
def _program(f, static, args, arrays):
  return f(*args, **arrays, **dict(static))


def attend(*args, **kw):
  return _one_program(sa.sparse_attention, args, kw)


def reference(*args, **kw):
  return _one_program(sa.sparse_attention_reference, args, kw)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5), static_argnames=("p", "pages_per_seq", "ragged"))
def make_inputs(seed, b, h, d, w, k, p=16, pages_per_seq=4, ragged=True):
  ks = jax.random.split(jax.random.key(seed), 10)
  q = jax.random.normal(ks[0], (b, h, d)).astype(jnp.bfloat16)
  swa_q, swa_s = sa.quantize_swa_fp8(jax.random.normal(ks[1], (b, w, d)))
  npages = b * pages_per_seq + 3                      # a few pages nobody uses
  kvp, kvs = sa.quantize_kv_fp4(jax.random.normal(ks[2], (npages, p, d)))
  page_table = jax.random.permutation(ks[3], npages)[: b * pages_per_seq]
  page_table = page_table.reshape(b, pages_per_seq).astype(jnp.int32)
  topk = jax.random.randint(ks[4], (b, k), 0, pages_per_seq * p).astype(jnp.int32)
  swa_valid = jnp.ones((b, w), bool)
  if ragged:
    swa_valid = jax.random.bernoulli(ks[5], 0.75, (b, w))
    topk = jnp.where(jax.random.bernoulli(ks[6], 0.25, (b, k)), -1, topk)
    swa_valid = swa_valid.at[0].set(False)           # sequence 0: no key at all
    topk = topk.at[0].set(-1)
  sink = jax.random.normal(ks[7], (h,))
  return q, swa_q, swa_s, swa_valid, topk, page_table, kvp, kvs, sink


@functools.partial(jax.jit, static_argnums=1)  # the seed traced: one compile a shape
def _rope_angles(seed, b):
  """(cos, sin) of random angles in [0, 6) for b rows of 32 pairs, as one program."""
  ang = jax.random.uniform(jax.random.key(seed), (b, 32)) * 6
  return jnp.cos(ang), jnp.sin(ang)


def rel_l2(a, b):
  a = np.asarray(a, np.float32)
  b = np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ----------------------------------------------------------------- formats
def test_quantizers_roundtrip_and_decoders():
  x, packed, scale, y, dec, dec_arith, y_f8, swa, ue8m0 = _quantizer_outputs()
  assert packed.shape == (4, 128) and packed.dtype == jnp.uint8
  assert scale.shape == (4, 16) and scale.dtype == jnp.uint8
  assert rel_l2(y, x) < 0.15                          # 4-bit quantization error
  # Both e2m1 decoders agree on every byte.
  np.testing.assert_array_equal(dec, dec_arith)
  # float8 scale input is accepted as well as its uint8 bits.
  np.testing.assert_array_equal(y_f8, y)
  assert rel_l2(swa, x) < 0.05
  np.testing.assert_array_equal(ue8m0, np.array([1.0, 2.0, 2.0 ** -126], np.float32))


@jax.jit  # one program: eagerly, the quantizers and decoders are ~100 small compiles (~40 ms each on the CPU)
def _quantizer_outputs():
  x = jax.random.normal(jax.random.key(1), (4, 256)) * 3
  packed, scale = sa.quantize_kv_fp4(x)
  allb = jnp.arange(256, dtype=jnp.uint8)
  sf8 = jax.lax.bitcast_convert_type(scale, jnp.float8_e4m3fn)
  return (x, packed, scale, sa.dequant_kv_fp4(packed, scale), sa.decode_e2m1_packed(allb),
          sa.decode_e2m1_packed(allb, arithmetic=True), sa.dequant_kv_fp4(packed, sf8),
          sa.dequant_swa_fp8(*sa.quantize_swa_fp8(x)), sa.decode_ue8m0(jnp.array([127, 128, 1], jnp.uint8)))


def _prmt(a, b, sel):
  by = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
  out = 0
  for i in range(4):
    s = (sel >> (4 * i)) & 0xF
    v = by[s & 7]
    if s & 8:
      v = 0xFF if v & 0x80 else 0
    out |= v << (8 * i)
  return out


def test_fp4_ptx_bit_logic_emulated():
  """Emulates FP4_WORD_PTX (prmt LUT + sign merge) for every byte value."""
  import ml_dtypes
  assert "prmt.b32 ha, 0x3F3F3F00, 0x40404040, sa;" in sa.FP4_WORD_PTX
  rng = np.random.default_rng(0)
  words = list(rng.integers(0, 2 ** 32, 300, dtype=np.uint64)) + [
      int.from_bytes(bytes([v, v, v, v]), "little") for v in range(256)]
  # every word decoded in one call (a call per word: ~550 eager dispatches of its ops)
  wants = np.asarray(jax.jit(sa.decode_e2m1_packed)(np.array(
      [np.frombuffer(int(w).to_bytes(4, "little"), np.uint8) for w in words])))
  for w, want in zip(words, wants):
    w = int(w)
    sa_, sb = w & 0x7777, (w >> 16) & 0x7777
    ha, la = _prmt(0x3F3F3F00, 0x40404040, sa_), _prmt(0xC0800000, 0xC0804000, sa_)
    hb, lb = _prmt(0x3F3F3F00, 0x40404040, sb), _prmt(0xC0800000, 0xC0804000, sb)
    so, se = w & 0x80808080, (w << 4) & 0x80808080
    ha |= _prmt(se, so, 0x5140)
    hb |= _prmt(se, so, 0x7362)
    regs = [_prmt(la, ha, 0x5140), _prmt(la, ha, 0x7362),
            _prmt(lb, hb, 0x5140), _prmt(lb, hb, 0x7362)]
    halves = np.array([[r & 0xFFFF, r >> 16] for r in regs], np.uint16).reshape(-1)
    got = halves.view(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_swizzle_offsets_are_a_permutation():
  t, d = 64, 512
  offs = {sa._swizzled_chunk_offset(r, q, d) for r in range(t) for q in range(d // 8)}
  assert len(offs) == t * d // 8 and max(offs) == t * d * 2 - 16


# ----------------------------------------------------------------- reference
def test_reference_matches_dense_numpy():
  args = make_inputs(3, 2, 4, 128, 16, 24)
  q, swa_q, swa_s, swa_valid, topk, page_table, kvp, kvs, sink = args
  out = np.asarray(reference(*args, out_dtype=jnp.float32))
  qn = np.asarray(q, np.float64)
  swa = np.asarray(jax.jit(sa.dequant_swa_fp8)(swa_q, swa_s), np.float64)
  allkv = np.asarray(jax.jit(sa.dequant_kv_fp4)(kvp, kvs), np.float64)     # [pages, P, D]
  # numpy copies: indexed element by element below (eagerly, each index of a jax.Array is a small program)
  swa_valid, topk, page_table, sink = map(np.asarray, (swa_valid, topk, page_table, sink))
  p = kvp.shape[1]
  for b in range(q.shape[0]):
    keys = [swa[b, j] for j in range(swa.shape[1]) if swa_valid[b, j]]
    for g in np.asarray(topk[b]):
      if g >= 0:
        keys.append(allkv[int(page_table[b, g // p]), g % p])
    sk = np.asarray(sink, np.float64)
    if keys:
      kk = np.stack(keys)
      s = qn[b] @ kk.T / np.sqrt(q.shape[2])                       # [H, N]
      m = np.maximum(s.max(-1), sk)
      e = np.exp(s - m[:, None])
      want = e @ kk / (e.sum(-1) + np.exp(sk - m))[:, None]
    else:
      want = np.zeros((q.shape[1], q.shape[2]))
    np.testing.assert_allclose(out[b], want, rtol=2e-4, atol=2e-5)


def test_reference_rope_roundtrip():
  x, y, z = map(np.asarray, _rope_roundtrip())  # numpy: eagerly, each slice of a jax.Array is a small program
  np.testing.assert_allclose(y[..., :64], x[..., :64])
  np.testing.assert_allclose(z, x, atol=1e-5)


@jax.jit  # one program (eagerly, a compile an op)
def _rope_roundtrip():
  x = jax.random.normal(jax.random.key(0), (2, 4, 128))
  ang = jax.random.uniform(jax.random.key(1), (2, 32)) * 6
  y = sa.apply_rope_tail(x, jnp.cos(ang), jnp.sin(ang))
  z = sa.apply_rope_tail(y, jnp.cos(ang), jnp.sin(ang), inverse=True)
  return x, y, z


# ----------------------------------------------------------------- kernel (interpret)
@pytest.mark.parametrize("b,h,w,k,splits,mode", [
    (2, 16, 16, 40, 1, "redundant"),
    (2, 64, 24, 150, 1, "split"),      # 4 tiles per CTA > 2 smem stages
])
def test_kernel_interpret_matches_reference(b, h, w, k, splits, mode):
  d = 128
  args = make_inputs(10 + b + k, b, h, d, w, k)
  ref = reference(*args, out_dtype=jnp.float32)
  out = attend(*args, backend="interpret", num_splits=splits, config=sa.KernelConfig(qk_mode=mode))
  assert out.shape == (b, h, d) and out.dtype == jnp.bfloat16
  out = np.asarray(out, np.float32)
  assert np.all(np.isfinite(out))
  assert rel_l2(out, ref) < 1e-2
  np.testing.assert_array_equal(out[0], 0.0)        # sequence 0 has no key


def test_kernel_interpret_consumers_alone_read_no_keys():
  """KernelConfig(fetch_keys=False), the timing variant of the consumers alone: the producer fills no stage, so
  the output cannot depend on the keys (the interpreter's stages start as NaN: equal NaN outputs; a producer
  that still fetched would give two different finite outputs)."""
  cfg = sa.KernelConfig(qk_mode="split", fetch_keys=False)
  outs = []
  for seed in (1, 2):
    args = list(make_inputs(seed, 2, 16, 128, 16, 40, ragged=False))
    args[0] = make_inputs(1, 2, 16, 128, 16, 40, ragged=False)[0]  # the same queries
    outs.append(np.asarray(attend(*args, backend="interpret", num_splits=1, config=cfg), np.float32))
  np.testing.assert_array_equal(outs[0], outs[1])


def test_kernel_interpret_rope_precomputed_rows_three_splits():
  b, h, d, w, k = 1, 8, 128, 72, 20      # 2 ring tiles (padded) + 1 pool tile
  args = make_inputs(5, b, h, d, w, k, ragged=False)
  kw = dict(zip(("rope_cos", "rope_sin"), _rope_angles(2, b)), rope_query=True, rope_output=True)
  ref = reference(*args, **kw, out_dtype=jnp.float32)
  rows = jax.jit(sa.compressed_rows, static_argnums=2)(args[4], args[5], args[6].shape[1])
  out = attend(*args, backend="interpret", rows=rows, num_splits=3, **kw)
  assert rel_l2(out, ref) < 1e-2
  # count-style swa_valid gives the same as the equivalent mask
  # (built on the host: eagerly, each jnp op is a compile)
  cnt = np.array([5], np.int32)
  a2 = list(args)
  a2[3] = jax.device_put(cnt)
  r2 = attend(*a2, backend="xla")
  a2[3] = jax.device_put(np.arange(w)[None] < cnt[:, None])
  np.testing.assert_array_equal(r2, attend(*a2, backend="xla"))


def unfused_and_fused_rope(args, kw, backend, splits, mode):
  """The kernel's outputs (float32) with q / o rotated around it in XLA, then inside it (fuse_rope)."""
  run = attend if backend == "interpret" else sa.sparse_attention  # the GPU tests call it as run on the H200
  return [np.asarray(run(*args, backend=backend, num_splits=splits, **kw,
                         config=sa.KernelConfig(qk_mode=mode, fuse_rope=fuse)), np.float32)
          for fuse in (False, True)]


@pytest.mark.parametrize("d,splits,mode", [(128, 1, "redundant"), (256, 1, "split"), (128, 3, "split")])
def test_kernel_interpret_fused_rope_equals_xla_rope(d, splits, mode):
  """RoPE inside the kernel (query chunk rotated in shared memory; the output's in the epilogue with one key
  split, in the XLA combine with more) gives the same bits as rotating q and o in XLA around the kernel."""
  b, h, w, k = 2, 16, 24, 70
  args = make_inputs(30 + d + splits, b, h, d, w, k, ragged=False)
  kw = dict(zip(("rope_cos", "rope_sin"), _rope_angles(d + splits, b)), rope_query=True, rope_output=True)
  ref = reference(*args, **kw, out_dtype=jnp.float32)
  outs = unfused_and_fused_rope(args, kw, "interpret", splits, mode)
  assert rel_l2(outs[1], ref) < 1e-2
  np.testing.assert_array_equal(outs[1], outs[0])
  # only the query rotated (the output left as it is), and a wrong rotation is caught
  q_only = dict(kw, rope_output=False)
  ref_q = reference(*args, **q_only, out_dtype=jnp.float32)
  got = attend(*args, backend="interpret", num_splits=splits, **q_only,
               config=sa.KernelConfig(qk_mode=mode, fuse_rope=True))
  assert rel_l2(got, ref_q) < 1e-2
  if d == 128 and splits == 1:  # once: the check itself can fail
    bad = attend(*args, backend="interpret", num_splits=splits, **dict(q_only, rope_sin=-np.asarray(kw["rope_sin"])),
                 config=sa.KernelConfig(qk_mode=mode, fuse_rope=True))
    assert rel_l2(bad, ref_q) > 0.1


def test_rope_tables():
  t, x, want = map(np.asarray, _rope_tables_case())
  np.testing.assert_array_equal(t[0, 0], [1, 1, 1, 1, 0.5, 0.5, -0.25, -0.25])
  np.testing.assert_array_equal(t[0, 1], [0, 0, 0, 0, -0.75, 0.75, -0.125, 0.125])
  swapped = x.reshape(1, 3, 4, 2)[..., ::-1].reshape(x.shape)
  np.testing.assert_allclose(x * t[:, None, 0] + swapped * t[:, None, 1], want, rtol=1e-6, atol=1e-6)


@jax.jit  # one program (eagerly, a compile an op)
def _rope_tables_case():
  cos, sin = jnp.array([[0.5, -0.25]]), jnp.array([[0.75, 0.125]])
  x = jax.random.normal(jax.random.key(0), (1, 3, 8))
  return sa.rope_tables(cos, sin, rope_w=8), x, sa.apply_rope_tail(x, cos, sin)


def test_kernel_interpret_flat_window_rows():
  """Prefill form: every query row names its own window rows in one flat FP8 key buffer (shared, overlapping,
  -1 holes, a query with no window key), equal to the reference and to the per-row-copy decode form."""
  b, h, d, w, k = 3, 16, 128, 20, 30
  args = make_inputs(21, b, h, d, w, k, ragged=False)
  q, swa_q, swa_s, _, topk, page_table, kvp, kvs, sink = args
  rng = np.random.default_rng(4)
  n = b * w
  # the rows and the window copies on the host: eagerly, each jnp op is a compile (~40 ms on the CPU)
  rows = np.where(rng.random((b, w)) < 0.2, -1, rng.integers(0, n, (b, w))).astype(np.int32)
  rows[2] = -1
  flat_q, flat_s = np.asarray(swa_q).reshape(n, d), np.asarray(swa_s).reshape(n, d // 32)
  flat = (q, flat_q, flat_s, None, topk, page_table, kvp, kvs, sink)
  ref = reference(*flat, swa_rows=rows, out_dtype=jnp.float32)
  out = attend(*flat, backend="interpret", swa_rows=rows, num_splits=1)
  assert rel_l2(out, ref) < 1e-2
  # the same windows copied per row (decode form) give the same reference
  copy_q, copy_s = flat_q[np.maximum(rows, 0)], flat_s[np.maximum(rows, 0)]
  ref2 = reference(q, copy_q, copy_s, rows >= 0, topk, page_table, kvp, kvs, sink, out_dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(ref), np.asarray(ref2), rtol=1e-6, atol=1e-6)


def _quantized_pool(fmt, key, r, d, scale=5.0):
  """r random rows quantized as the pool stores them (FP4 compressed KV or FP8 SWA ring) -> (src, scale,
  tile_of); tile_of(rows) -> the bf16 tile and the bias a producer must write for those pool rows (-1: none).
  Each part one jitted program: eagerly, the quantizer and the expected tile are dozens of small compiles (~40 ms
  each on the CPU)."""
  src, sc = _pool(fmt, key, r, d, scale)
  return src, sc, functools.partial(_tile_of, fmt, src, sc)


@functools.partial(jax.jit, static_argnums=(0, 2, 3, 4))
def _pool(fmt, key, r, d, scale):
  x = jax.random.normal(key, (r, d)) * scale
  return sa.quantize_kv_fp4(x) if fmt == "fp4" else sa.quantize_swa_fp8(x)


@functools.partial(jax.jit, static_argnums=0)
def _tile_of(fmt, src, sc, rows):
  deq = sa.dequant_kv_fp4 if fmt == "fp4" else sa.dequant_swa_fp8
  g = jnp.maximum(rows, 0)
  tile = jnp.where((rows >= 0)[..., None], deq(src[g], sc[g]), 0).astype(jnp.bfloat16)
  return tile, jnp.where(rows >= 0, 0.0, -jnp.inf)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _pool_rows(key, shape, hi, hole):
  """Random pool rows in [0, hi) of `shape`, -1 at index `hole` (one program)."""
  return jax.random.randint(key, shape, 0, hi).astype(jnp.int32).at[hole].set(-1)


def test_dequant_probe_interpret_exact():
  key = jax.random.key(4)
  rows = _pool_rows(key, (sa.TILE,), 50, 7)
  kvp, kvs, tile_of = _quantized_pool("fp4", key, 50, 128, scale=1.0)
  out, bias = jax.jit(functools.partial(sa.dequant_probe, "fp4", interpret=True))(kvp, kvs, rows)
  want, want_bias = tile_of(rows)
  np.testing.assert_array_equal(out, want)
  np.testing.assert_array_equal(bias, want_bias)


def test_producer_stream_interpret_last_tile_exact():
  """The producer-alone timing kernel dequantizes every CTA's tiles in turn; its last tile is exact."""
  key = jax.random.key(5)
  rows = _pool_rows(key, (2, 3, sa.TILE), 70, (1, 2, 5))
  kvp, kvs, tile_of = _quantized_pool("fp4", key, 70, 128, scale=1.0)
  out, bias = jax.jit(functools.partial(sa.producer_stream, "fp4", interpret=True))(kvp, kvs, rows)
  want, want_bias = tile_of(np.asarray(rows)[:, -1])  # each CTA's last tile
  np.testing.assert_array_equal(out, want)
  np.testing.assert_array_equal(bias, want_bias)


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_producer_stream_lowers_for_cuda(fmt):
  d, r = 512, 4096
  src = jax.ShapeDtypeStruct((r, d // 2 if fmt == "fp4" else d), jnp.uint8)
  sc = jax.ShapeDtypeStruct((r, d // 16 if fmt == "fp4" else d // 32), jnp.uint8)
  rows = jax.ShapeDtypeStruct((128, 5, sa.TILE), jnp.int32)
  jax.jit(lambda a, b, c: sa.producer_stream(fmt, a, b, c)).trace(src, sc, rows).lower(
      lowering_platforms=("cuda",))


def test_kernel_lowers_for_cuda_at_flash_shapes():
  """Mosaic GPU lowering (layouts, smem budget, wgmma shapes) runs on CPU."""
  b, h, d, w, k, p = 2, 64, 512, 128, 512, 64
  sds = jax.ShapeDtypeStruct
  shapes = (sds((b, h, d), jnp.bfloat16), sds((b, w, d), jnp.uint8),
            sds((b, w, d // 32), jnp.uint8), sds((b, w), jnp.bool_),
            sds((b, k), jnp.int32), sds((b, 16), jnp.int32),
            sds((64, p, d // 2), jnp.uint8), sds((64, p, d // 16), jnp.uint8),
            sds((h,), jnp.float32))
  for splits, mode in ((1, "redundant"), (5, "split")):
    f = jax.jit(lambda *a, s=splits, m=mode: sa.sparse_attention_decode(
        *a, num_splits=s, config=sa.KernelConfig(qk_mode=m)))
    f.trace(*shapes).lower(lowering_platforms=("cuda",))
  # RoPE fused: the query's chunk rotated in shared memory (both splits), the output's in the epilogue (one)
  cs = (sds((b, 32), jnp.float32),) * 2
  for splits, mode in ((1, "redundant"), (1, "split"), (5, "split")):
    f = jax.jit(lambda *a, s=splits, m=mode: sa.sparse_attention_decode(
        *a[:-2], rope_cos=a[-2], rope_sin=a[-1], rope_query=True, rope_output=True, num_splits=s,
        config=sa.KernelConfig(qk_mode=m, fuse_rope=True)))
    f.trace(*shapes, *cs).lower(lowering_platforms=("cuda",))
  # the consumers alone (timing variant)
  f = jax.jit(lambda *a: sa.sparse_attention_decode(
      *a, num_splits=2, config=sa.KernelConfig(qk_mode="split", fetch_keys=False)))
  f.trace(*shapes).lower(lowering_platforms=("cuda",))


# ----------------------------------------------------------------- GPU
@gpu
@skip_no_gpu
@pytest.mark.parametrize("b,splits,mode", [(1, None, "redundant"), (3, 1, "split"),
                                           (3, 2, "redundant")])
def test_kernel_gpu_flash_shapes(b, splits, mode):
  args = make_inputs(20 + b, b, 64, 512, 128, 512, p=64, pages_per_seq=16)
  ref = sa.sparse_attention_reference(*args, out_dtype=jnp.float32)
  out = sa.sparse_attention(*args, backend="pallas", num_splits=splits, config=sa.KernelConfig(qk_mode=mode))
  out = np.asarray(out, np.float32)
  assert np.all(np.isfinite(out))
  assert rel_l2(out, ref) < 1e-2
  np.testing.assert_array_equal(out[0], 0.0)


@gpu
@skip_no_gpu
@pytest.mark.parametrize("splits,mode", [(1, "redundant"), (1, "split"), (2, "split")])
def test_kernel_gpu_fused_rope(splits, mode):
  """The in-kernel RoPE (register pair swap, shared-memory rewrite of the query chunk) against XLA's."""
  b = 3
  args = make_inputs(40 + splits, b, 64, 512, 128, 512, p=64, pages_per_seq=16)
  kw = dict(zip(("rope_cos", "rope_sin"), _rope_angles(splits, b)), rope_query=True, rope_output=True)
  ref = sa.sparse_attention_reference(*args, **kw, out_dtype=jnp.float32)
  outs = unfused_and_fused_rope(args, kw, "pallas", splits, mode)
  assert rel_l2(outs[1], ref) < 1e-2
  # one bf16 step at most: the GPU may contract x*c + x'*s into an FMA on one side and not the other
  np.testing.assert_allclose(outs[1], outs[0], rtol=2.0**-7, atol=1e-3 * np.abs(outs[0]).max())


@gpu
@skip_no_gpu
@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_producer_stream_gpu_exact(fmt):
  key = jax.random.key(13)
  rows = _pool_rows(key, (4, 3, sa.TILE), 500, (2, 2, 9))
  src, sc, tile_of = _quantized_pool(fmt, key, 500, 512)
  out, bias = sa.producer_stream(fmt, src, sc, rows)
  want, want_bias = tile_of(rows[:, -1])  # each CTA's last tile
  np.testing.assert_array_equal(out, want)
  np.testing.assert_array_equal(bias, want_bias)


@gpu
@skip_no_gpu
@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_dequant_probe_gpu_exact(fmt):
  key = jax.random.key(9)
  rows = _pool_rows(key, (sa.TILE,), 300, 3)
  src, sc, tile_of = _quantized_pool(fmt, key, 300, 512)
  out, bias = sa.dequant_probe(fmt, src, sc, rows)
  want, want_bias = tile_of(rows)
  np.testing.assert_array_equal(out, want)
  np.testing.assert_array_equal(bias, want_bias)
