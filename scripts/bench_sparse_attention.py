#!/usr/bin/env python3
"""Check and time the fused sparse-attention decode kernel on a GPU (H200).

Run on the device machine, from the repository root:

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/bench_sparse_attention.py

What it does, in one process:
  1. probes the producer's dequant (FP4 and FP8 tiles) against jnp;
  2. checks the kernel against the f32 reference at Flash shapes (H=64, D=512,
     W=128, K=512) for B in {1, 8, 64} and several key-split counts, plus a
     ragged-validity case (invalid ring slots, -1 indices, a sequence with no
     key at all).  Pass: relative L2 error < 1e-2, no NaN (bf16 P and bf16
     output give ~2e-3);
  3. measures a copy bandwidth (torch device-to-device copy, 2 GiB; XLA f32
     copy as a second figure) as the roofline ceiling;
  4. times kernel vs the XLA reference with CUPTI (per-kernel GPU time, medians
     over repeats after warm-up), with L2 flushed before every call ("cold",
     the decode case) and back-to-back ("warm"), and the same attention in PyTorch
     over bf16 caches (scripts/torch_baselines.py, CUDA events, L2 flushed);
  5. prints one table and writes JSON to $OUT (or ./out) when set.
Bytes per sequence = q (H*D*2) + ring (W*528) + K*288 + output (H*D*2).
"""

import argparse
import functools
import json
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # torch_baselines

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import sparse_attention as sa  # noqa: E402

T0 = time.time()


def log(*a):
  print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def make_inputs(key, b, *, h=64, d=512, w=128, k=512, p=64, pages_per_seq=256,
                ragged=False):
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
  out = jnp.asarray(out, jnp.float32)
  ref = jnp.asarray(ref, jnp.float32)
  nan = bool(jnp.any(jnp.isnan(out)))
  e = float(jnp.linalg.norm(out - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))
  mx = float(jnp.max(jnp.abs(out - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30))
  return e, mx, nan


# ---------------------------------------------------------------- timing
_CUPTI_OK = None


def _cupti_measure(f, args, iters):
  """List (one per call) of lists of (kernel name, ms)."""
  from jax.experimental.mosaic.gpu import profiler
  _, ts = profiler.measure(f, aggregate=False, iterations=iters)(*args)
  if iters == 1:
    ts = [ts]
  return [list(r) for r in ts]


def cuda_event_median_s(op, iters, warmup=3):
  """Median seconds of one op() between two CUDA events (PyTorch), after `warmup` untimed calls: the ceilings'
  PyTorch side, shared by the benches (scripts/torch_baselines.py times the same way)."""
  import torch_baselines as tb
  return tb.cuda_time_us(op, iters=iters, warmup=warmup) * 1e-6


def wall_median_s(f, args, iters=10):
  """Median wall-clock seconds of one blocking call f(*args), after one warm-up call."""
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t)
  return statistics.median(ts)


def time_gpu(f, args, *, iters=20, cold=False, flush=None):
  """Returns (median total GPU ms per call, median ms of the longest kernel,
  kernel names) measured with CUPTI; falls back to wall clock."""
  global _CUPTI_OK
  jax.block_until_ready(f(*args))
  if _CUPTI_OK is not False:
    try:
      runs = []
      if cold:
        for _ in range(iters):
          jax.block_until_ready(flush())
          runs.extend(_cupti_measure(f, args, 1))
      else:
        runs = _cupti_measure(f, args, iters)
      _CUPTI_OK = True
      tot = statistics.median(sum(t for _, t in r) for r in runs)
      mx = statistics.median(max(t for _, t in r) for r in runs)
      return tot, mx, [n for n, _ in runs[0]]
    except Exception as e:  # noqa: BLE001
      log("CUPTI measure failed, using wall clock:", repr(e)[:300])
      _CUPTI_OK = False
  ts = []
  for _ in range(iters):
    if cold:
      jax.block_until_ready(flush())
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append((time.perf_counter() - t0) * 1e3)
  m = statistics.median(ts)
  return m, m, ["wall-clock"]


def torch_baseline(inp, ref32, iters):
  """The same decode attention in PyTorch over bf16 caches (scripts/torch_baselines.py; the FP8 ring and the FP4
  pool dequantized once, outside the timing): -> (cold us with L2 flushed, rel. L2 error vs the f32 reference)."""
  import torch
  import torch_baselines as tb

  q, swa_q, swa_s, swa_valid, topk, page_table, kv_packed, kv_scale, sink = inp
  w, d = swa_q.shape[1:]
  p = kv_packed.shape[1]
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
  us = tb.cuda_time_us(lambda: tb.decode_attention(*args), iters=iters, flush=tb.l2_flusher())
  del args, pool
  torch.cuda.empty_cache()
  return us, err


def copy_bandwidth():
  res = {}
  n = int(os.environ.get("BENCH_COPY_BYTES", 2 << 30))
  try:
    import torch
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    x.random_(0, 255)
    y = torch.empty_like(x)
    res["torch_copy_TBps"] = 2 * n / cuda_event_median_s(functools.partial(y.copy_, x), iters=10) / 1e12
    del x, y
    torch.cuda.empty_cache()
  except Exception as e:  # noqa: BLE001
    log("torch copy failed:", repr(e)[:200])
  try:
    x = jax.random.normal(jax.random.key(0), (n // 8,), jnp.float32)
    f = jax.jit(lambda v: v * 1.0001)
    tot, _, _ = time_gpu(f, (x,), iters=10)
    res["xla_f32_copy_TBps"] = 2 * x.nbytes / (tot * 1e-3) / 1e12
    del x
  except Exception as e:  # noqa: BLE001
    log("xla copy failed:", repr(e)[:200])
  return res


def producer_pool(key, fmt, d, rows=1 << 18):
  """A pool of `rows` random cache rows (FP4: e2m1 bytes + e4m3 scales; FP8: e4m3 + UE8M0), well past the L2."""
  k1, k2 = jax.random.split(key)
  if fmt == "fp4":
    src = jax.random.bits(k1, (rows, d // 2), jnp.uint8)
    sc = jax.random.randint(k2, (rows, d // 16), 0x30, 0x48, jnp.int32).astype(jnp.uint8)  # finite e4m3
  else:
    src = jax.random.bits(k1, (rows, d), jnp.uint8)
    src = jnp.where((src & 0x7F) == 0x7F, 0x7E, src).astype(jnp.uint8)  # no e4m3 NaN
    sc = jax.random.randint(k2, (rows, d // 32), 120, 130, jnp.int32).astype(jnp.uint8)
  return src, sc


# ---------------------------------------------------------------- main
def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--variants", default="1:10:r,1:10:s,8:10:r,8:10:s,64:1:r,64:1:s,64:2:r,64:2:s",
                  help="B:S:mode[:nopf][:rpbN][:nofetch] entries; mode r=redundant, s=split QK; nofetch: "
                       "timing only, the consumers alone (KernelConfig(fetch_keys=False))")
  ap.add_argument("--skip-probe", action="store_true")
  ap.add_argument("--producer", default="",
                  help="also time the producer alone (sa.producer_stream): CTAsxTILES:fmt entries, e.g. "
                       "128x5:fp4,128x2:fp8 (batch 64, 2 splits: each CTA's 5 FP4 and 2 FP8 tiles)")
  ap.add_argument("--interpret", action="store_true",
                  help="CPU smoke test of this script (Mosaic GPU interpreter)")
  args = ap.parse_args()
  out_dir = os.environ.get("OUT", "out")
  os.makedirs(out_dir, exist_ok=True)
  log("devices", jax.devices(), "jax", jax.__version__)
  h, d, w, k = 64, 512, 128, 512
  n_tiles = w // sa.TILE + k // sa.TILE
  variants = {}
  for v in args.variants.split(","):
    f = v.split(":")
    bb, ss, mode = int(f[0]), int(f[1]), f[2]
    cfg = {"qk_mode": {"r": "redundant", "s": "split"}[mode]}
    for extra in f[3:]:
      if extra == "nopf":
        cfg["prefetch"] = False
      elif extra.startswith("rpb"):
        cfg["rows_per_batch"] = int(extra[3:])
      elif extra == "nofetch":
        cfg["fetch_keys"] = False
    variants.setdefault(bb, []).append((ss, v, sa.KernelConfig(**cfg)))
  results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "checks": [], "timings": []}

  # 1. dequant probes
  if not args.skip_probe:
    for fmt in ("fp4", "fp8"):
      try:
        key = jax.random.key(7)
        inp = make_inputs(key, 1, pages_per_seq=8)
        if fmt == "fp4":
          src, sc = inp[6].reshape(-1, d // 2), inp[7].reshape(-1, d // 16)
        else:
          src, sc = inp[1].reshape(-1, d), inp[2].reshape(-1, d // 32)
        rows = jax.random.randint(key, (sa.TILE,), 0, src.shape[0], jnp.int32).at[5].set(-1)
        out, bias = sa.dequant_probe(fmt, src, sc, rows, interpret=args.interpret)
        g = jnp.maximum(rows, 0)
        deq = sa.dequant_kv_fp4 if fmt == "fp4" else sa.dequant_swa_fp8
        ref = jnp.where((rows >= 0)[:, None], deq(src[g], sc[g]), 0).astype(jnp.bfloat16)
        exact = bool(jnp.array_equal(out, ref))
        nbad = int(jnp.sum(out != ref))
        bias_ok = bool(jnp.array_equal(bias, jnp.where(rows >= 0, 0.0, -jnp.inf)))
        log(f"probe {fmt}: exact={exact} mismatches={nbad} bias_ok={bias_ok}")
        if not exact:
          bad = np.argwhere(np.asarray(out != ref))[:8]
          log("  first mismatches (row, col, got, want):",
              [(int(r), int(c), float(out[r, c]), float(ref[r, c])) for r, c in bad])
        results["checks"].append({"probe": fmt, "exact": exact, "mismatches": nbad,
                                  "bias_ok": bias_ok})
      except Exception as e:  # noqa: BLE001
        log(f"probe {fmt} FAILED:", repr(e)[:2000])
        traceback.print_exc()
        results["checks"].append({"probe": fmt, "error": repr(e)[:2000]})

  # 2. correctness + 4. timing per batch size
  flush_buf = jnp.zeros((64 << 20,), jnp.float32)          # 256 MiB > 60 MB L2
  flush_fn = jax.jit(lambda x: x + 1.0)
  flush = lambda: flush_fn(flush_buf)                       # noqa: E731
  bw = copy_bandwidth()
  log("copy bandwidth:", bw)
  results["bandwidth"] = bw
  ceiling = bw.get("torch_copy_TBps") or bw.get("xla_f32_copy_TBps") or 4.3

  ref_fn = jax.jit(sa.sparse_attention_reference)
  rows = []
  for b in variants:             # in the order given on the command line
    inp = make_inputs(jax.random.key(b), b)
    ref = ref_fn(*inp)
    ref32 = jax.jit(lambda *a: sa.sparse_attention_reference(*a, out_dtype=jnp.float32))(*inp)
    bytes_ = b * (h * d * 2 + w * 528 + k * 288 + h * d * 2)
    flops = b * 4 * h * d * (w + k)
    try:
      t_x, t_xk, names_x = time_gpu(ref_fn, inp, iters=args.iters, cold=True, flush=flush)
    except Exception as e:  # noqa: BLE001
      log("xla timing failed", repr(e)[:300])
      t_x, names_x = float("nan"), []
    log(f"B={b}: XLA reference {t_x * 1e3:.1f} us (cold), kernels {names_x[:6]}")
    t_torch = e_torch = float("nan")
    if not args.interpret:
      try:
        t_torch, e_torch = torch_baseline(inp, ref32, args.iters)
        log(f"B={b}: PyTorch over bf16 caches {t_torch:.1f} us (cold), rel_l2 {e_torch:.2e}")
      except Exception as e:  # noqa: BLE001
        log("torch baseline failed", repr(e)[:300])
    for s, vname, cfg in variants[b]:
      s = s or sa.default_num_splits(b, n_tiles)
      entry = {"B": b, "S": s, "variant": vname, "config": str(cfg),
               "bytes": bytes_, "flops": flops}
      try:
        f = jax.jit(lambda *a, _s=s, _c=cfg: sa.sparse_attention_decode(
            *a, num_splits=_s, interpret=args.interpret, config=_c))
        t_c0 = time.time()
        out = jax.block_until_ready(f(*inp))
        entry["compile_run_s"] = time.time() - t_c0
        e, mx, nan = rel_err(out, ref32)
        e_xla, _, _ = rel_err(ref, ref32)
        # timing-only variants (the consumers alone) compute over unfilled stages: nothing to check
        ok = (e < 1e-2 and not nan) if cfg.fetch_keys else "timing"
        entry.update(rel_l2=e, rel_max=mx, nan=nan, ok=ok, xla_rel_l2=e_xla)
        log(f"{vname} B={b} S={s}: rel_l2={e:.2e} rel_max={mx:.2e} nan={nan} "
            f"(xla bf16 out vs f32: {e_xla:.2e}) compile+run {entry['compile_run_s']:.1f}s")
        if b == 8 and cfg.fetch_keys:
          rinp = make_inputs(jax.random.key(100 + b), b, ragged=True)
          rout = f(*rinp)
          rref = sa.sparse_attention_reference(*rinp, out_dtype=jnp.float32)
          re_, rmx, rnan = rel_err(rout, rref)
          row1 = rel_err(rout[1], rref[1])[0]
          z0 = float(jnp.max(jnp.abs(rout[0].astype(jnp.float32))))
          entry.update(ragged_rel_l2=re_, ragged_nan=rnan, ragged_row1=row1,
                       ragged_row0_maxabs=z0)
          log(f"  ragged: rel_l2={re_:.2e} nan={rnan} row1(5 keys)={row1:.2e} "
              f"row0(no keys) max|o|={z0:.2e}")
        t_all, t_k, names = time_gpu(f, inp, iters=args.iters, cold=True, flush=flush)
        t_warm, t_kw, _ = time_gpu(f, inp, iters=args.iters, cold=False)
        entry.update(path_us=t_all * 1e3, kernel_us=t_k * 1e3, warm_path_us=t_warm * 1e3,
                     warm_kernel_us=t_kw * 1e3, xla_us=t_x * 1e3, torch_us=t_torch, torch_rel_l2=e_torch,
                     kernels=names)
        log(f"  cold: path {t_all * 1e3:.1f} us, main kernel {t_k * 1e3:.1f} us; "
            f"warm: path {t_warm * 1e3:.1f} us, kernel {t_kw * 1e3:.1f} us; kernels {names}")
      except Exception as ex:  # noqa: BLE001
        log(f"{vname} B={b} S={s} FAILED:", repr(ex)[:3000])
        traceback.print_exc()
        entry["error"] = repr(ex)[:3000]
      rows.append(entry)
      results["timings"].append(entry)

  # 5. table
  print()
  print(f"copy ceiling: {ceiling:.2f} TB/s ({bw})")
  hdr = (f"{'variant':>14} {'B':>3} {'S':>3} {'kern us':>8} {'path us':>8} {'warm us':>8} {'XLA us':>8} "
         f"{'speedup':>7} {'torch us':>8} {'vs torch':>8} {'MB':>7} {'TB/s':>6} {'%BW':>5} {'TFLOP/s':>7} "
         f"{'rel_l2':>8} ok")
  print(hdr)
  for r in rows:
    if "error" in r:
      print(f"{r['variant']:>14} {r['B']:>3} {r['S']:>3}  ERROR {r['error'][:150]}")
      continue
    tb = r["bytes"] / (r["path_us"] * 1e-6) / 1e12
    print(f"{r['variant']:>14} {r['B']:>3} {r['S']:>3} {r['kernel_us']:8.1f} {r['path_us']:8.1f} "
          f"{r['warm_path_us']:8.1f} {r['xla_us']:8.1f} {r['xla_us'] / r['path_us']:7.2f} "
          f"{r['torch_us']:8.1f} {r['torch_us'] / r['path_us']:8.2f} {r['bytes'] / 1e6:7.2f} {tb:6.2f} "
          f"{100 * tb / ceiling:5.1f} "
          f"{r['flops'] / (r['path_us'] * 1e-6) / 1e12:7.1f} {r['rel_l2']:8.1e} {r['ok']}")
  # 6. the producer alone: the gathers and dequantization of the same tiles per CTA with no consumer to wait
  # for; against the kernel's time at those tiles per CTA it says whether the producer is what limits it
  results["producer"] = []
  if args.producer:
    print("\nproducer alone (CUPTI, L2 flushed):")
    print(f"{'CTAs':>5} {'tiles':>5} {'fmt':>4} {'us':>8} {'us/tile':>8}")
  for spec in filter(None, args.producer.split(",")):
    shape, fmt = spec.split(":")
    ctas, tiles = map(int, shape.split("x"))
    src, sc = producer_pool(jax.random.key(11), fmt, d)
    prow = jax.random.randint(jax.random.key(12), (ctas, tiles, sa.TILE), 0, src.shape[0], jnp.int32)
    f = jax.jit(lambda a, b_, c, _f=fmt: sa.producer_stream(_f, a, b_, c, interpret=args.interpret))
    entry = {"ctas": ctas, "tiles": tiles, "fmt": fmt}
    try:
      t_p, _, _ = time_gpu(f, (src, sc, prow), iters=args.iters, cold=True, flush=flush)
      print(f"{ctas:>5} {tiles:>5} {fmt:>4} {t_p * 1e3:8.1f} {t_p * 1e3 / tiles:8.2f}")
      results["producer"].append({**entry, "us": t_p * 1e3})
    except Exception as ex:  # noqa: BLE001
      log(f"producer {spec} FAILED:", repr(ex)[:2000])
      results["producer"].append({**entry, "error": repr(ex)[:2000]})
  with open(os.path.join(out_dir, "bench_sparse_attention.json"), "w") as fh:
    json.dump(results, fh, indent=1, default=str)
  log("done")


if __name__ == "__main__":
  main()
