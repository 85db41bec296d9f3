#!/usr/bin/env python3
"""Check and time the fused mHC site (pallas_kernels/mhc.py) at Flash shapes (hc=4, D=5120, fn [24, 20480]).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/bench_mhc.py --out $OUT [--tokens 64,1,8,512]

Per T (the expand site; then the first site, y=None, while --budget-s lasts): the pallas path against the XLA path
(dsv41.mhc's composition). Checks: h1 within two bf16 ulps on <= 1% of elements; x and pre/post/comb (abs <= 2e-5)
against the reference applied to the kernel's own h1 (a bf16 tie flip in h1 moves the mix by |fn| * ulp, not a
kernel error); all finite. Times: CUPTI sum over a call's kernels, the longest kernel, one blocking call's wall
clock; roofline = bytes (fn f32 + h, y read + h1, x written) / this run's HBM ceiling.
"""

from __future__ import annotations

import timing  # noqa: I001  (first: puts the repository on sys.path)
import jax
import jax.numpy as jnp
import numpy as np

from dsv41.config import ModelConfig
from pallas_kernels import mhc as M
from timing import fmt, log

ROWS: list[dict] = []


def make_inputs(key, t, d, hc=4):
    k = jax.random.split(key, 9)
    y = jax.random.normal(k[0], (t, d)).astype(jnp.bfloat16)
    h = (jax.random.normal(k[1], (t, hc, d)) * 3).astype(jnp.bfloat16)
    post = 2 * jax.nn.sigmoid(jax.random.normal(k[2], (t, hc)))
    comb = jax.nn.softmax(jax.random.normal(k[3], (t, hc, hc)), -1)
    pre = jax.nn.sigmoid(jax.random.normal(k[4], (t, hc))) + 1e-6
    fn = jax.random.normal(k[5], (24, hc * d)) * 0.02
    scale = jax.random.uniform(k[6], (3,), minval=0.5, maxval=2.0)
    base = jax.random.normal(k[7], (24,))
    w = (1 + 0.1 * jax.random.normal(k[8], (d,))).astype(jnp.bfloat16)
    return [y, h, post, comb, pre, fn, scale, base, w]


def compare(out, ref):
    """-> (ok, {name: error figure})."""
    errs, ok = {}, True
    for name, o, r in zip(("h1", "x", "pre", "post", "comb"), out, ref):
        o, r = (np.asarray(jnp.asarray(v, jnp.float32)) for v in (o, r))
        if o.shape != r.shape or not np.all(np.isfinite(o)):
            errs[name], ok = "shape/nonfinite", False
            continue
        if name in ("h1", "x"):  # the rule of tests/pallas_kernels/test_mhc.py: <= 2 bf16 ulps (+1e-6 absolute:
            # near-zero results of cancelling sums), on <= 1% of elements
            excess = float(np.max(np.abs(o - r) - (2 ** -6 * np.abs(r) + 1e-6)))
            frac = float(np.mean(o != r))
            errs[name] = f"excess {max(excess, 0):.1e} differ {frac:.1e}"
            ok &= bool(excess <= 0 and frac <= 0.01)
        else:
            e = float(np.max(np.abs(o - r)))
            errs[name] = f"{e:.1e}"
            ok &= e <= 2e-5
    return ok, errs


def op_bytes(t, hc, d, first):
    """fn (f32) + h read and h1 written (the first site writes no h1) + y read (not at the first site) + x."""
    return 24 * hc * d * 4 + (t * hc * d * 2 + t * d * 2) * (1 if first else 2)


def main():
    ap = timing.bench_args(__doc__, iters=20, budget_s=110)
    ap.add_argument("--tokens", default="64,1,8,512")
    args = ap.parse_args()
    cfg = ModelConfig()
    hc, d = cfg.hc_mult, cfg.dim
    tokens = [int(v) for v in args.tokens.split(",") if v]
    ceil = timing.bench_ceilings()
    bw = ceil["hbm_TBps"]

    def dump():  # after each case: a killed run keeps its rows
        timing.write_json(args.out, "bench_mhc.json", {"ceilings": ceil, "rows": ROWS, "elapsed_s": timing.elapsed_s()})

    def wall(f, a):  # median us of one blocking call: launch gaps and host work, which CUPTI's sum does not see
        jax.block_until_ready(f(*a))
        return timing.median_wall_s(lambda: jax.block_until_ready(f(*a)), args.iters) * 1e6

    def run_case(t, first):
        row = {"T": t, "site": "first" if first else "expand"}
        ROWS.append(row)
        with timing.guarded(f"T={t} {row['site']}", row, check="ERROR"):
            a = make_inputs(jax.random.key(1000 + t), t, d)
            if first:
                a[0] = a[2] = a[3] = None
            pal = jax.jit(lambda *b: M.mhc_fused(*b, cfg, backend="pallas"))
            xla = jax.jit(lambda *b: M.mhc_fused(*b, cfg, backend="xla"))
            out = jax.block_until_ready(pal(*a))
            ref = jax.block_until_ready(xla(*a))
            ok, errs = compare(out[:1], ref[:1])  # h1 vs the reference; the rest vs the reference on our h1
            cond = jax.block_until_ready(xla(None, out[0], None, None, *a[4:]))
            ok2, errs2 = compare(out, cond)
            ok &= ok2
            errs.update({k: v for k, v in errs2.items() if k != "h1"})
            errs["h1->coef (info)"] = compare(out, ref)[1]["pre"]
            row.update(check="PASS" if ok else "FAIL", errors=errs)
            nbytes = op_bytes(t, hc, d, first)
            row.update(MB=nbytes / 1e6, roofline_us=nbytes / (bw * 1e12) * 1e6)
            tot, mx, names = timing.time_gpu(pal, a, iters=args.iters)
            row.update(pallas_us=tot * 1e3, pallas_kernel_us=mx * 1e3, pallas_launches=len(names),
                       pallas_kernels=names, pallas_wall_us=wall(pal, a))
            tx, _, nx = timing.time_gpu(xla, a, iters=args.iters)
            row.update(xla_us=tx * 1e3, xla_launches=len(nx), xla_kernels=nx, xla_wall_us=wall(xla, a))
            log({k: v for k, v in row.items() if not k.endswith("_kernels")})
        dump()

    for t in tokens:
        run_case(t, False)
    for t in tokens:
        if timing.over_budget(args.budget_s, "the remaining first-site cases"):
            break
        run_case(t, True)
    table(bw)


def table(bw):
    print(f"\nfused mHC site, hc=4, roofline at {bw:.2f} TB/s (bytes: fn f32 + h, y in + h1, x out); "
          "us columns: CUPTI GPU time summed over the call's kernels (#k), kernel = the longest one; "
          "wall = one blocking call")
    out = []
    for r in ROWS:
        p, x, rf = r.get("pallas_us"), r.get("xla_us"), r.get("roofline_us")
        out.append([r["T"], r["site"], r.get("check", "?"), fmt(p, "{:.1f}"), fmt(r.get("pallas_kernel_us"), "{:.1f}"),
                    r.get("pallas_launches", "-"), fmt(x, "{:.1f}"), r.get("xla_launches", "-"), fmt(rf),
                    fmt(x / p if p and x else None), fmt(rf / p if p and rf else None, "{:.3f}"),
                    fmt(r.get("pallas_wall_us"), "{:.1f}"), fmt(r.get("xla_wall_us"), "{:.1f}"),
                    r.get("errors", r.get("error", "")[:300])])
    timing.print_table(["T", "site", "check", "pallas us", "kernel us", "#k", "xla us", "#k", "roof us", "xla/pal",
                        "roof/pal", "wall pal", "wall xla", "errors"], out, "rll" + "r" * 10 + "l")


if __name__ == "__main__":
    main()
