#!/usr/bin/env python3
"""Check and time the fused decode KV writes (pallas_kernels/kv_write.py) at Flash shapes.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/bench_kv_write.py --out $OUT
    .venv/bin/python scripts/bench_kv_write.py --cpu-smoke     # CPU: interpreter, small pools

Cases: FULL ratio 2 (layers 2/8/14), FULL ratio 1 (layer 20, 256-slot ring), SWA-only, at B = 64, 8, 1. Each is
one jitted program of --steps decode steps of one layer, pool donated: `xla` (kv_write_reference, the model's
path) and `fused` (kv_write_decode, XLA prelude + one Mosaic GPU kernel, pool aliased). Both start from the same
poisoned pool; every pool array must then be identical byte for byte (PASS). Timing: wall clock a step
(scripts/timing.py, pipelined calls); roofline = bytes a step must move / the HBM ceiling of the same run:
everything here is launch-bound, so the time columns are the point.
"""

from __future__ import annotations

import dataclasses
import time

import timing  # noqa: I001  (first: puts the repository on sys.path)
import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import rope
from dsv41.config import ModelConfig
from pallas_kernels import kv_write as kw
from timing import fmt, log

CFG = ModelConfig()
KINDS = {"full-r2 (L2)": (2, 2), "full-r1 (L20)": (1, 20), "swa-only (L0)": (0, 0)}


@dataclasses.dataclass(frozen=True)
class Shape:
    B: int
    S: int  # sequence slots
    R: int  # ring
    P: int  # pages
    E: int  # entries per page
    C: int  # block-table columns


def shape_for(ratio, layer, B, smoke):
    page_tokens = 64
    S = max(B, 8) if smoke else 128
    C = 4 if smoke else 16
    E = page_tokens // max(ratio, 1)
    R = 2 * CFG.window_size if layer == CFG.split_layer else CFG.window_size
    return Shape(B=B, S=S, R=R if not smoke else 16, P=S * C + 1, E=E, C=C)


def make_pool(ratio, sh: Shape, seed):
    """A poisoned layer pool (random bytes / normal floats): unwritten bytes stay recognisable."""
    Dh, ID = CFG.head_dim, CFG.index_head_dim
    k = jax.random.split(jax.random.key(seed), 8)

    def u8(i, shape, dtype=jnp.uint8):
        a = jax.random.randint(k[i], shape, 0, 256, jnp.int32).astype(jnp.uint8)
        return a if dtype == jnp.uint8 else jax.lax.bitcast_convert_type(a, dtype)

    lkv = kw.LayerKV(u8(0, (sh.S, sh.R, Dh), jnp.float8_e4m3fn), u8(1, (sh.S, sh.R, Dh // 32)))
    if ratio:
        lkv = dataclasses.replace(
            lkv, kv_packed=u8(2, (sh.P, sh.E, Dh // 2)), kv_scale=u8(3, (sh.P, sh.E, Dh // 16), jnp.float8_e4m3fn),
            ik_packed=u8(4, (sh.P, sh.E, ID // 2)), ik_scale=u8(5, (sh.P, sh.E, ID // 32)),
            comp_state=jax.random.normal(k[6], (sh.S, 2 * Dh), jnp.float32) if ratio == 2 else None)
    return lkv


def make_inputs(ratio, layer, sh: Shape, steps, seed):
    """Per-step token inputs [steps, B, ...] and a batch: distinct slots and pages, the last row padding when
    B > 1, write_lo blocking one row's early groups."""
    Dh, ID = CFG.head_dim, CFG.index_head_dim
    rng = np.random.default_rng(seed)
    B = sh.B
    slot = rng.permutation(sh.S)[:B].astype(np.int32)
    n_valid = np.ones(B, np.int32)
    if B > 1:
        slot[-1], n_valid[-1] = sh.S, 0
    span = sh.C * sh.E * max(ratio, 1)
    pos = rng.integers(0, span - steps, B).astype(np.int32)
    write_lo = np.zeros(B, np.int32)
    if B > 2:
        write_lo[0] = pos[0] + steps // 2
    bt = rng.permutation(sh.P)[: B * sh.C].reshape(B, sh.C).astype(np.int32)
    x = {"swa_kv": jnp.asarray(rng.standard_normal((steps, B, Dh)), jnp.bfloat16), "slot": jnp.asarray(slot),
         "pos": jnp.asarray(pos), "n_valid": jnp.asarray(n_valid), "block_table": jnp.asarray(bt),
         "write_lo": jnp.asarray(write_lo)}
    static = {}
    if ratio:
        x["comp_kv"] = jnp.asarray(rng.standard_normal((steps, B, Dh)), jnp.float32 if ratio == 2 else jnp.bfloat16)
        if ratio == 2:
            x["comp_score"] = jnp.asarray(rng.standard_normal((steps, B, Dh)), jnp.float32)
        x["p_comp"] = {"norm": jnp.asarray(1 + 0.1 * rng.standard_normal(Dh), jnp.bfloat16)}
        x["p_idx"] = {"wk": jnp.asarray(rng.standard_normal((ID, Dh)) / np.sqrt(Dh), jnp.bfloat16),
                      "k_norm": jnp.asarray(1 + 0.1 * rng.standard_normal(ID), jnp.bfloat16)}
        static["freqs"] = rope.inv_freq(CFG, layer)
    return x, static


def step_program(ratio, static, steps, variant):
    """-> jitted f(lkv, x) running `steps` decode steps; variant 'xla' | 'fused' | 'interpret'."""
    kc = kw.KVWriteConfig(ratio, CFG.norm_eps)

    backend = {"xla": "xla", "fused": "pallas", "interpret": "interpret"}[variant]

    def run(lkv, x):
        for t in range(steps):
            comp = {} if not ratio else {"comp_kv": x["comp_kv"][t], "p_comp": x["p_comp"], "p_idx": x["p_idx"],
                                         "comp_score": x["comp_score"][t] if ratio == 2 else None,
                                         "freqs": static["freqs"]}
            lkv = kw.kv_write_decode(lkv, x["swa_kv"][t], x["slot"], x["pos"] + t, x["n_valid"], x["block_table"],
                                     x["write_lo"], kcfg=kc, backend=backend, **comp)
        return lkv

    return jax.jit(run, donate_argnums=0)


def time_program(compiled, lkv, args, reps, calls=5):
    """Median seconds per call over `reps` groups of `calls` pipelined calls (the donated pool is chained)."""
    state = [jax.block_until_ready(compiled(lkv, *args))]

    def group():
        for _ in range(calls):
            state[0] = compiled(state[0], *args)
        jax.block_until_ready(state[0])

    return timing.median_wall_s(group, reps) / calls


def step_bytes(ratio, B) -> int:
    """Bytes a step must move at least: token inputs read + rows written (entries counted for every row)."""
    Dh, ID = CFG.head_dim, CFG.index_head_dim
    n = B * Dh * 2 + B * (Dh + Dh // 32)  # swa kv in, ring row out
    if ratio:
        n += B * Dh * (8 if ratio == 2 else 2)  # compressor kv (+ score) in
        n += ID * Dh * 2 + 2 * (Dh + ID)  # wk, norms
        n += B * (Dh // 2 + Dh // 16 + ID // 2 + ID // 32)  # entries out
    if ratio == 2:
        n += 2 * B * 2 * Dh * 4  # state in and out
    return n


def diff_bytes(a: kw.LayerKV, b: kw.LayerKV) -> dict:
    out = {}
    for f in dataclasses.fields(kw.LayerKV):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x is None:
            continue
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype.itemsize == 1:
            x, y = x.view(np.uint8), y.view(np.uint8)
        else:
            x, y = x.view(np.uint32), y.view(np.uint32)
        out[f.name] = int((x != y).sum())
    return out


def run_case(kind, B, args, bw, smoke):
    ratio, layer = KINDS[kind]
    sh = shape_for(ratio, layer, B, smoke)
    steps = args.steps
    row = {"kind": kind, "B": B, "steps": steps, "shape": dataclasses.asdict(sh)}
    x, static = make_inputs(ratio, layer, sh, steps, seed=B * 7 + ratio)
    pool0 = make_pool(ratio, sh, 1)
    # every program is compiled once (AOT) and serves both the check and the timing
    comp = {}
    for name, variant in {"xla": "xla", "fused": "interpret" if smoke else "fused"}.items():
        with timing.guarded(f"{kind} B {B} {name} compile", row, f"err_{name}"):
            t = time.time()
            comp[name] = step_program(ratio, static, steps, variant).lower(pool0, x).compile()
            log(kind, "B", B, name, f"compiled in {time.time() - t:.1f}s")
    del pool0

    def run(name):  # from a fresh copy of the same poisoned pool
        return comp[name](make_pool(ratio, sh, 1), x)

    with timing.guarded(f"{kind} B {B} check", row, "check_error", check="ERROR"):  # fused vs the XLA path
        ref, out = run("xla"), run("fused")
        d, changed = diff_bytes(out, ref), diff_bytes(make_pool(ratio, sh, 1), ref)
        row["diff_bytes"], row["changed_bytes"] = d, changed
        row["check"] = "PASS" if sum(d.values()) == 0 and sum(changed.values()) > 0 else "FAIL"
        log(kind, "B", B, row["check"], "differing bytes", d, "bytes written", sum(changed.values()))
    for name in ("xla", "fused"):
        if name not in comp:
            continue
        with timing.guarded(f"{kind} B {B} {name} timing", row, f"err_time_{name}"):
            t = time_program(comp[name], make_pool(ratio, sh, 2), (x,), args.reps, 1 if smoke else 5)
            row[f"us_{name}"] = t / steps * 1e6
            log(kind, "B", B, name, f"{row[f'us_{name}']:.2f} us/step")
    row["bytes"] = step_bytes(ratio, B)
    row["us_roofline"] = row["bytes"] / (bw * 1e12) * 1e6
    return row


def print_table(rows, bw):
    print(f"\nHBM ceiling measured: {bw:.2f} TB/s. Times: us per decode step of one layer "
          f"(wall clock, median, {rows[0]['steps'] if rows else '?'} steps per program).", flush=True)
    out = []
    for r in rows:
        x, f, roof = r.get("us_xla"), r.get("us_fused"), r.get("us_roofline")
        diff = sum(r["diff_bytes"].values()) if "diff_bytes" in r else None
        out.append([r["kind"], r["B"], r["check"], fmt(diff, "{}"), fmt(x), fmt(f), fmt(roof, "{:.4f}"),
                    fmt(x / f if x and f else None), fmt(f / roof if f and roof else None, "{:.0f}x")])
    timing.print_table(["case", "B", "check", "diff B", "xla us", "fused us", "roof us", "xla/fused", "fused/roof"],
                       out)


def main():
    ap = timing.bench_args(__doc__, budget_s=105.0)
    ap.add_argument("--steps", type=int, default=4, help="decode steps per program (unrolled)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--batches", default="64,8,1")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--cpu-smoke", action="store_true", help="interpreter, small pools, B=1 (logic only)")
    args = ap.parse_args()
    smoke = args.cpu_smoke
    if smoke:  # the interpreter is slow: check the logic, not the numbers
        args.steps, args.batches, args.reps = 2, "1", 1
    bwres = {"hbm_TBps": 4.3} if smoke else timing.bench_ceilings()
    bw, rows = bwres["hbm_TBps"], []
    for B in (int(b) for b in args.batches.split(",")):
        for kind in args.kinds.split(","):
            if timing.over_budget(args.budget_s, f"{kind} B={B}"):
                continue
            try:
                rows.append(run_case(kind, B, args, bw, smoke))
            except Exception as ex:  # noqa: BLE001
                rows.append({"kind": kind, "B": B, "check": "ERROR", "steps": args.steps,
                             "error": timing.failure(f"{kind} B={B}", ex)})
        timing.write_json(args.out, "bench_kv_write.json", {"bandwidth": bwres, "rows": rows, "args": vars(args)})
    print_table(rows, bw)
    log("done")


if __name__ == "__main__":
    main()
