#!/usr/bin/env python3
"""Check and time the sparse MQA indexer logits kernel + top-k (pallas_kernels/indexer_logits.py) at Flash shapes.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 scripts/bench_indexer.py --out $OUT [--cases c:64:16,x:1:64]

Flash shapes: 32 index heads of 128, ratio 2, 64 entries a page, MXFP4 keys, top-512, 2048 candidate blocks of 8;
candidates mode (layers past 20) or context mode (all ctx/2 entries); row 0 of a B>1 case sees half its context.
Checks the kernel's scores against the XLA reference (-inf pattern equal, no NaN, <= 2 bf16 ulps, <= 1% not
bit-identical) and its top-k against the reference's and XLA's; CUPTI time (L2 flushed) of the kernel alone, the
whole `index_topk`, today's XLA path and each top-k method alone; roofline = bytes / the HBM ceiling of this run.
"""

from __future__ import annotations

import functools
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import timing  # noqa: E402  (first: puts the repository on sys.path)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from pallas_kernels import indexer_logits as il  # noqa: E402
from timing import log  # noqa: E402


def time_gpu(f, args, *, iters, flush):  # -> (median us a call, us of its longest kernel, kernel count, method)
    tot, mx, names = timing.time_gpu(f, args, iters=iters, flush=flush)
    how = timing.how(names)
    return tot * 1e3, mx * 1e3, len(names) if how == "cupti" else 0, how


IH, ID, RATIO, E = 32, 128, 2, 64
ENTRY_BYTES = ID // 2 + ID // 32
SELECT_METHODS = tuple(m for m in il.TOPK_METHODS if m != "auto")  # lax first: the ids compared against


def make_case(seed, B, ctx, mode):
    G = ctx // RATIO
    pages_per_row = G // E
    ks = jax.random.split(jax.random.key(seed), 8)
    P = B * pages_per_row + 1
    q = jax.random.normal(ks[0], (B, 1, IH, ID), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(ks[1], (B, 1, IH), jnp.float32) * 0.03).astype(jnp.bfloat16)
    pk = jax.random.bits(ks[2], (P, E, ID // 2), jnp.uint8)
    sc = jax.random.randint(ks[3], (P, E, ID // 32), 124, 129, jnp.int32).astype(jnp.uint8)
    bt = jax.random.permutation(ks[4], P)[: B * pages_per_row].reshape(B, pages_per_row).astype(jnp.int32)
    q_pos = jnp.full((B, 1), ctx - 1, jnp.int32)
    if B > 1:
        q_pos = q_pos.at[0, 0].set(ctx // 2 - 1)          # ragged: row 0 sees half of its entries
    cb = None
    if mode == "candidates":
        nb = G // 8
        if nb <= 2048:
            cb = jnp.concatenate([jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (B, nb)),
                                  jnp.full((B, 2048 - nb), -1, jnp.int32)], axis=1)
        else:
            cb = jax.vmap(lambda k: jnp.sort(jax.random.permutation(k, nb)[:2048]))(jax.random.split(ks[5], B))
            cb = cb.astype(jnp.int32)
    return q, w, pk, sc, bt, q_pos, cb, G


def check_scores(s, ref):
    s, ref = np.asarray(s, np.float32), np.asarray(ref, np.float32)
    nan = bool(np.isnan(s).any())
    inf_ok = bool((np.isneginf(s) == np.isneginf(ref)).all())
    fin = np.isfinite(ref) & np.isfinite(s)
    d = np.abs(s[fin] - ref[fin])
    rel = d / np.maximum(np.abs(ref[fin]), 1e-30)
    max_rel = float(rel.max()) if rel.size else 0.0
    frac_diff = float((d != 0).mean()) if d.size else 0.0
    ok = (not nan) and inf_ok and max_rel <= 2 ** -6 and frac_diff <= 0.01
    return ok, {"nan": nan, "inf_pattern_ok": inf_ok, "max_rel": max_rel, "frac_not_identical": frac_diff,
                "n_finite": int(fin.sum())}


def overlap(a, b):
    a, b = np.asarray(a), np.asarray(b)
    tot, hit = 0, 0
    for x, y in zip(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])):
        sx, sy = set(x[x >= 0].tolist()), set(y[y >= 0].tolist())
        tot += max(len(sx), len(sy))
        hit += len(sx & sy)
    return hit / max(tot, 1)


def run_case(mode, B, ctx, args, flush, bw, rows_out):
    row = {"mode": mode, "B": B, "ctx": ctx}
    rows_out.append(row)
    q, w, pk, sc, bt, q_pos, cb, G = make_case(1000 + B + ctx // 1024, B, ctx, mode)
    cfg = il.IndexerConfig()
    # Few, fused jits: op-by-op dispatch would compile every small op once per shape (seconds per case).
    k_top = cfg.index_topk
    if mode == "candidates":
        n = cb.shape[1] * 8

        @jax.jit
        def prep(cb, bt, q_pos):
            g = il.candidate_entries(cb)
            g = jnp.where(g < il.visible_count(q_pos, RATIO), g, -1)
            return il.pool_rows(g, bt, E, pk.shape[0]), il.blocks_to_mask(cb[:, None], G, 8)

        rows, cand_mask = prep(cb, bt, q_pos)
        path = jax.jit(lambda q, w, pk, sc, bt, q_pos, cb: il.index_topk(
            q, w, pk, sc, bt, q_pos, RATIO, cand_blocks=cb, cfg=cfg)[0])
        path_args = (q, w, pk, sc, bt, q_pos, cb)
        today = jax.jit(lambda q, w, pk, sc, bt, q_pos, m: il.index_topk_xla_today(
            q, w, pk, sc, bt, q_pos, RATIO, cand_mask=m, cfg=cfg))
        today_args = (q, w, pk, sc, bt, q_pos, cand_mask)
        scores_g = jax.jit(lambda *a: il.candidate_scores(*a, RATIO))  # (kernel scores, their entry ids)

        @jax.jit
        def reference(*a):
            s_r, g = il.candidate_scores(*a, RATIO, backend="xla")
            return s_r, il.topk_entries(s_r, g, k_top)

        sargs = (q, w, pk, sc, bt, cb, q_pos)
    else:
        n = G

        @jax.jit
        def prep(bt, q_pos):
            gg = jnp.broadcast_to(jnp.arange(G, dtype=jnp.int32)[None], (B, G))
            gg = jnp.where(gg < jnp.max(il.visible_count(q_pos, RATIO), axis=1, keepdims=True), gg, -1)
            return il.pool_rows(gg, bt, E, pk.shape[0])

        rows = prep(bt, q_pos)
        path = jax.jit(lambda q, w, pk, sc, bt, q_pos: il.index_topk(
            q, w, pk, sc, bt, q_pos, RATIO, num_entries=G, cfg=cfg)[0])
        path_args = (q, w, pk, sc, bt, q_pos)
        today = jax.jit(lambda q, w, pk, sc, bt, q_pos: il.index_topk_xla_today(
            q, w, pk, sc, bt, q_pos, RATIO, cfg=cfg))
        today_args = path_args

        def visible(q_pos):  # [B, 1, G] entry ids, -1 past each row's visible count
            g = jnp.arange(G, dtype=jnp.int32)
            return jnp.where(g[None, None] < il.visible_count(q_pos, RATIO)[..., None], g, -1)

        scores_g = jax.jit(lambda *a: (il.context_scores(*a, RATIO, G), visible(a[-1])))

        @jax.jit
        def reference(*a):
            s_r = il.context_scores(*a, RATIO, G, backend="xla")
            return s_r, il.topk_entries(s_r, visible(a[-1]), k_top)

        sargs = (q, w, pk, sc, bt, q_pos)
    nbytes = B * (n * ENTRY_BYTES + IH * ID * 2 + IH * 2 + n * 4 + n * 4)   # keys, q, w, row ids, f32 scores
    row.update(entries=n, bytes=nbytes)
    with timing.guarded(f"{mode} B={B} ctx={ctx}: check", row, "check_error", check="ERROR"):
        s_k = scores_g(*sargs)[0]
        s_r, tk_ref = reference(*sargs)
        ok, info = check_scores(s_k, s_r)
        row.update(check="PASS" if ok else "FAIL", **info)
        tk = path(*path_args)
        row.update(topk_overlap_vs_ref=overlap(tk, tk_ref), topk_overlap_vs_today=overlap(tk, today(*today_args)))
        log(f"{mode} B={B} ctx={ctx}:", {k: row[k] for k in ("check", "max_rel", "frac_not_identical",
                                                            "topk_overlap_vs_ref", "topk_overlap_vs_today")})
        del s_k, s_r
    kern = jax.jit(il.entry_scores_kernel)
    for name, f, a in (("kernel", kern, (q, w, pk, sc, rows)), ("path", path, path_args), ("xla", today, today_args)):
        if name == "xla" and args.no_xla:
            continue
        with timing.guarded(f"{mode} B={B} ctx={ctx}: {name} timing", row, f"{name}_error"):
            tot, mx, nk, how = time_gpu(f, a, iters=args.iters, flush=flush)
            row[f"{name}_us"] = mx if name == "kernel" else tot      # kernel: the Mosaic kernel alone
            row.update({f"{name}_total_us": tot, f"{name}_nkernels": nk, "timing": how})
    # the top-k alone on the kernel's scores: lax.top_k (a sort), the radix selects, the threshold kernel; same ids
    with timing.guarded(f"{mode} B={B} ctx={ctx}: top-k timing", row, "topk_error"):
        s_t, g_t = scores_g(*sargs)
        tk_fns = {m: jax.jit(functools.partial(il.topk_entries, k=k_top, method=m)) for m in SELECT_METHODS}
        want = np.asarray(tk_fns["lax"](s_t, g_t))
        row["topk_radix_same"] = all(np.array_equal(np.asarray(f(s_t, g_t)), want) for f in tk_fns.values())
        for m, f in tk_fns.items():
            # the longest kernel too: for 'kernel' the threshold kernel, the rest being XLA's placement
            row[f"topk_{m}_us"], row[f"topk_{m}_max_us"], row[f"topk_{m}_nkernels"], _ = time_gpu(
                f, (s_t, g_t), iters=args.iters, flush=flush)
        log(f"{mode} B={B} ctx={ctx}: top-k alone " + ", ".join(
            f"{m} {row[f'topk_{m}_us']:.1f} us ({row[f'topk_{m}_nkernels']} kernels, longest "
            f"{row[f'topk_{m}_max_us']:.1f})" for m in SELECT_METHODS) + f", same ids {row['topk_radix_same']}")
        del s_t, g_t
    if "kernel_us" in row:
        row["roofline_us"] = nbytes / (bw * 1e12) * 1e6
        row["pct_bw"] = 100 * row["roofline_us"] / row["kernel_us"]
    log(f"{mode} B={B} ctx={ctx}: " + ", ".join(f"{k}={row[k]:.1f}" for k in
                                               ("kernel_us", "path_us", "xla_us", "pct_bw") if k in row))


def print_table(rows, bw):
    print(f"\nHBM ceiling for the roofline: {bw:.2f} TB/s (kernel = the Mosaic kernel alone; kern+topk = the whole "
          "index_topk; XLA = today's path; CUPTI GPU time, L2 flushed; us)")

    def f(r, k, fmt=".1f"):
        return format(r[k], fmt) if k in r else "-"

    timing.print_table(
        ["mode", "B", "ctx", "check", "max_rel", "kernel", "kern+topk", "XLA", "XLA/path", "bytes", "roofline",
         "% of HBM", "topk lax"] + list(SELECT_METHODS[1:]) + ["same ids"],
        [[r["mode"], r["B"], f"{r['ctx'] // 1024}K", r.get("check", "-"), f(r, "max_rel", ".1e"), f(r, "kernel_us"),
          f(r, "path_us"), f(r, "xla_us"),
          f"{r['xla_us'] / r['path_us']:.1f}x" if "xla_us" in r and "path_us" in r else "-",
          f"{r.get('bytes', 0):,}", f(r, "roofline_us"), f(r, "pct_bw", ".0f"), f(r, "topk_lax_us")]
         + [f(r, f"topk_{m}_us") for m in SELECT_METHODS[1:]] + [str(r.get("topk_radix_same", "-"))] for r in rows])


def main():
    ap = timing.bench_args(__doc__, out="out", iters=10, budget_s=100.0)
    ap.add_argument("--cases", default="c:64:256,c:1:256,c:8:64,c:64:64,c:1:64,c:8:256,c:64:16,c:8:16,c:1:16,"
                                      "x:64:64,x:1:64,x:8:16,x:64:16,x:1:16,x:8:64",
                    help="mode(c=candidates, x=context):B:ctx in K tokens, most important first")
    ap.add_argument("--no-xla", action="store_true", help="skip timing today's XLA path")
    args = ap.parse_args()
    ceil, flush, rows = timing.bench_ceilings(), timing.jax_flusher(), []
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "ceilings": ceil, "rows": rows}
    for spec in args.cases.split(","):
        m, b, k = spec.split(":")
        case = {"mode": {"c": "candidates", "x": "context"}[m], "B": int(b), "ctx": int(k) * 1024}
        if timing.over_budget(args.budget_s, spec):
            rows.append({**case, "check": "SKIP"})
            continue
        try:
            run_case(*case.values(), args, flush, ceil["hbm_TBps"], rows)
        except Exception as ex:  # noqa: BLE001
            rows.append({**case, "check": "ERROR", "error": timing.failure(f"case {spec}", ex)})
        timing.write_json(args.out, "results.json", results)
    print_table(rows, ceil["hbm_TBps"])
    log("done")


if __name__ == "__main__":
    main()
