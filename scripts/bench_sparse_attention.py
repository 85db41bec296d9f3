"""Check and time the fused sparse-attention decode kernel (pallas_kernels/sparse_attention.py) on the H200.

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/bench_sparse_attention.py [--variants 1:10:r,64:2:s]

Checks the kernel against the f32 reference at Flash shapes (H=64, D=512, W=128, K=512) per batch and key-split
count, with a ragged case at B=8 (invalid ring slots, -1 indices, a sequence with no key): rel. L2 < 1e-2, no NaN.
Times (CUPTI) the kernel's path cold (L2 flushed) and warm, the XLA reference, and PyTorch over bf16 caches;
bytes a sequence = q (H*D*2) + ring (W*528) + K*288 + output (H*D*2), against this run's HBM ceiling.
"""

import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import timing  # noqa: E402  (first: puts the repository on sys.path)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from pallas_kernels import sparse_attention as sa  # noqa: E402
from timing import log, time_gpu  # noqa: E402


def make_inputs(key, b, *, h=64, d=512, w=128, k=512, p=64, pages_per_seq=256, ragged=False):
  ks = jax.random.split(key, 12)
  q = jax.random.normal(ks[0], (b, h, d), jnp.float32).astype(jnp.bfloat16)
  bits = jax.random.randint(ks[1], (b, w, d), 0, 256, jnp.int32)
  bits = jnp.where((bits & 0x7F) == 0x7F, bits ^ 1, bits)          # no e4m3 NaN
  swa_q = bits.astype(jnp.uint8)
  swa_s = jax.random.randint(ks[2], (b, w, d // 32), 118, 124, jnp.int32).astype(jnp.uint8)
  npages = b * pages_per_seq
  kv_packed = jax.random.randint(ks[3], (npages, p, d // 2), 0, 256, jnp.int32).astype(jnp.uint8)
  kv_scale = jax.random.randint(ks[4], (npages, p, d // 16), 0x20, 0x40, jnp.int32).astype(jnp.uint8)
  page_table = jax.random.permutation(ks[5], npages).reshape(b, pages_per_seq).astype(jnp.int32)
  topk = jnp.sort(jax.random.randint(ks[6], (b, k), 0, pages_per_seq * p, jnp.int32), axis=1)
  sink = jax.random.normal(ks[7], (h,), jnp.float32)
  swa_valid = jnp.ones((b, w), bool)
  if ragged:
    swa_valid = jax.random.bernoulli(ks[8], 0.7, (b, w)).at[0].set(False)
    topk = jnp.where(jax.random.bernoulli(ks[9], 0.3, (b, k)), -1, topk).at[0].set(-1)
    if b > 1:   # a sequence with only a few ring slots and no compressed entry
      swa_valid = swa_valid.at[1].set(jnp.arange(w) < 5)
      topk = topk.at[1].set(-1)
  return (q, swa_q, swa_s, swa_valid, topk, page_table, kv_packed, kv_scale, sink)


def rel_err(out, ref):
  out, ref = jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32)
  nan = bool(jnp.any(jnp.isnan(out)))
  e = float(jnp.linalg.norm(out - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))
  mx = float(jnp.max(jnp.abs(out - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30))
  return e, mx, nan


def torch_baseline(inp, ref32, iters):
  """The same decode attention in PyTorch over bf16 caches (scripts/torch_baselines.py; the FP8 ring and the FP4
  pool dequantized once, outside the timing): -> (cold us with L2 flushed, rel. L2 error vs the f32 reference)."""
  import torch
  import torch_baselines as tb

  q, swa_q, swa_s, swa_valid, topk, page_table, kv_packed, kv_scale, sink = inp
  (w, d), p = swa_q.shape[1:], kv_packed.shape[1]
  g = jnp.maximum(topk, 0)
  rows = jnp.where(topk >= 0, jnp.take_along_axis(page_table, g // p, axis=1) * p + g % p, -1)
  pool = sa.dequant_kv_fp4(kv_packed.reshape(-1, d // 2), kv_scale.reshape(-1, d // 16))
  # the mask travels as int8: DLPack's bool is not exchanged by every jax/torch pair
  args = [q, sa.dequant_swa_fp8(swa_q, swa_s).astype(jnp.bfloat16), sa.swa_valid_mask(swa_valid, w).astype(jnp.int8),
          pool.astype(jnp.bfloat16), rows, jnp.asarray(sink, jnp.float32)]
  args = [torch.from_dlpack(jax.block_until_ready(a)) for a in args]
  args[2] = args[2].bool()
  out = tb.decode_attention(*args)
  err = rel_err(jnp.asarray(out.float().cpu().numpy()), ref32)[0]
  us = timing.cuda_time_us(lambda: tb.decode_attention(*args), iters=iters, flush=timing.l2_flusher())
  del args, pool
  torch.cuda.empty_cache()
  return us, err


def main():
  ap = timing.bench_args(__doc__, out="out", iters=20)
  ap.add_argument("--variants", default="1:10:r,1:10:s,8:10:r,8:10:s,64:1:r,64:1:s,64:2:r,64:2:s",
                  help="B:S:mode entries (S key splits, 0: the default); mode r=redundant, s=split QK")
  args = ap.parse_args()
  h, d, w, k = 64, 512, 128, 512
  n_tiles = w // sa.TILE + k // sa.TILE
  variants = {}
  for v in args.variants.split(","):
    bb, ss, mode = v.split(":")
    qk_mode = {"r": "redundant", "s": "split"}[mode]
    variants.setdefault(int(bb), []).append((int(ss), v, sa.KernelConfig(qk_mode=qk_mode)))
  flush, bw, rows = timing.jax_flusher(), timing.bench_ceilings(), []
  results, ceiling = {"timings": rows, "ceilings": bw}, bw["hbm_TBps"]
  ref_fn = jax.jit(sa.sparse_attention_reference)
  for b in variants:             # in the order given on the command line
    inp = make_inputs(jax.random.key(b), b)
    ref = ref_fn(*inp)
    ref32 = jax.jit(lambda *a: sa.sparse_attention_reference(*a, out_dtype=jnp.float32))(*inp)
    bytes_, flops = b * (h * d * 2 + w * 528 + k * 288 + h * d * 2), b * 4 * h * d * (w + k)
    t_x = t_torch = e_torch = float("nan")
    with timing.guarded(f"B={b} XLA timing"):
      t_x, _, names_x = time_gpu(ref_fn, inp, iters=args.iters, flush=flush)
      log(f"B={b}: XLA reference {t_x * 1e3:.1f} us (cold), kernels {names_x[:6]}")
    with timing.guarded(f"B={b} PyTorch baseline"):
      t_torch, e_torch = torch_baseline(inp, ref32, args.iters)
      log(f"B={b}: PyTorch over bf16 caches {t_torch:.1f} us (cold), rel_l2 {e_torch:.2e}")
    for s, vname, cfg in variants[b]:
      s = s or sa.default_num_splits(b, n_tiles)
      entry = {"B": b, "S": s, "variant": vname, "config": str(cfg), "bytes": bytes_, "flops": flops}
      with timing.guarded(f"{vname} B={b} S={s}", entry):
        f = jax.jit(lambda *a, _s=s, _c=cfg: sa.sparse_attention_decode(*a, num_splits=_s, config=_c))
        t_c0 = time.time()
        out = jax.block_until_ready(f(*inp))
        entry["compile_run_s"] = time.time() - t_c0
        (e, mx, nan), e_xla = rel_err(out, ref32), rel_err(ref, ref32)[0]
        entry.update(rel_l2=e, rel_max=mx, nan=nan, ok=e < 1e-2 and not nan, xla_rel_l2=e_xla)
        log(f"{vname} B={b} S={s}: rel_l2={e:.2e} rel_max={mx:.2e} nan={nan} "
            f"(xla bf16 out vs f32: {e_xla:.2e}) compile+run {entry['compile_run_s']:.1f}s")
        if b == 8:
          rinp = make_inputs(jax.random.key(100 + b), b, ragged=True)
          rout = f(*rinp)
          rref = sa.sparse_attention_reference(*rinp, out_dtype=jnp.float32)
          re_, _, rnan = rel_err(rout, rref)
          row1 = rel_err(rout[1], rref[1])[0]
          z0 = float(jnp.max(jnp.abs(rout[0].astype(jnp.float32))))
          entry.update(ragged_rel_l2=re_, ragged_nan=rnan, ragged_row1=row1, ragged_row0_maxabs=z0)
          log(f"  ragged: rel_l2={re_:.2e} nan={rnan} row1(5 keys)={row1:.2e} row0(no keys) max|o|={z0:.2e}")
        t_all, t_k, names = time_gpu(f, inp, iters=args.iters, flush=flush)
        t_warm, t_kw, _ = time_gpu(f, inp, iters=args.iters)
        entry.update(path_us=t_all * 1e3, kernel_us=t_k * 1e3, warm_path_us=t_warm * 1e3,
                     warm_kernel_us=t_kw * 1e3, xla_us=t_x * 1e3, torch_us=t_torch, torch_rel_l2=e_torch, kernels=names)
        log(f"  cold: path {t_all * 1e3:.1f} us, main kernel {t_k * 1e3:.1f} us; "
            f"warm: path {t_warm * 1e3:.1f} us, kernel {t_kw * 1e3:.1f} us; kernels {names}")
      rows.append(entry)

  print(f"\nceilings: {timing.ceiling_line(bw)}")
  table = []
  for r in rows:
    if "error" in r:
      table.append([r["variant"], r["B"], r["S"], "ERROR " + r["error"][:100]] + [""] * 11)
      continue
    us = r["path_us"]
    tb = r["bytes"] / (us * 1e-6) / 1e12
    table.append([r["variant"], r["B"], r["S"], f"{r['kernel_us']:.1f}", f"{us:.1f}", f"{r['warm_path_us']:.1f}",
                  f"{r['xla_us']:.1f}", f"{r['xla_us'] / us:.2f}", f"{r['torch_us']:.1f}", f"{r['torch_us'] / us:.2f}",
                  f"{r['bytes'] / 1e6:.2f}", f"{tb:.2f}", f"{100 * tb / ceiling:.1f}",
                  f"{r['flops'] / (us * 1e-6) / 1e12:.1f}", f"{r['rel_l2']:.1e} {r['ok']}"])
  timing.print_table(["variant", "B", "S", "kernel us", "path us", "warm us", "XLA us", "speedup", "torch us",
                      "vs torch", "MB", "TB/s", "% HBM", "TFLOP/s", "rel_l2 ok"], table)
  timing.write_json(args.out, "bench_sparse_attention.json", results)
  log("done")


if __name__ == "__main__":
  main()
