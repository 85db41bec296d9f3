#!/usr/bin/env python3
"""Time instruction variants of the FP4 expert GEMM's register decode, and PDL on a stack of MoE layers (H200).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 scripts/bench_decode_variants.py [--moe-chain] [--experts 64]

Every variant is the same bit layout (`expert_gemm.FP4_DECODE`: the same prepared weights, the same results) with
the word's shifts written for another pipe: `mul.lo` by a power of two (ptxas already emits IMAD.SHL for the
kernel's two left shifts), the rotate by 10 as `mul.wide` (IMAD.WIDE: its halves OR'd), the right shift as
`mul.hi` (IMAD.HI). `scripts/sass_stats.py` on the kernel's PTX counts what each becomes. Each variant is checked
against `expert_gemm_reference` (8 experts, one token) before it is timed; then the kernel alone (CUPTI, the
median of 5 repeats over 4 routings) at 1 and 8 tokens for w1/w3 (4608 x 5120) and w2 (5120 x 2304), the
variants interleaved round by round so that drift shows. `--moe-chain`: 8 MoE layers' routed experts
(`dsv41.moe.routed_experts`, different routings) in one jitted program, wall time a layer with and without
`KernelConfig.pdl`. Prints one table. 64 experts by default: with 384 this script's process ran out of memory
twice (one token touches 6 experts either way).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_expert_gemm as B  # noqa: E402
from pallas_kernels import expert_gemm as eg  # noqa: E402

# Register j of word $4 with scale byte $5, as the kernel's `_FP4_PTX`, each shift by one of two instructions
_HEAD = (".reg .b32 a0, a1, a2, a3, t1, t2, t3, t4, m, lo, hi;\n.reg .b64 w;\n"
         "mul.lo.u32 m, $5, 0x00800080;\nand.b32 a0, $4, 0x81C081C0;\n")
_TAIL = "".join(f"mul.rn.bf16x2 ${j}, a{j}, m;\n" for j in range(4))
_PARTS = {
    "left4": {"shl": "shl.b32 t1, $4, 4;\n", "mul": "mul.lo.u32 t1, $4, 16;\n"},
    "rot10": {"shf": "shf.l.wrap.b32 t2, $4, $4, 10;\n",
              "wide": "mul.wide.u32 w, $4, 1024;\nmov.b64 {lo, hi}, w;\nor.b32 t2, lo, hi;\n"},
    "left6": {"shl": "shl.b32 t3, $4, 6;\n", "mul": "mul.lo.u32 t3, $4, 64;\n"},
    "right2": {"shr": "shr.b32 t4, $4, 2;\n", "mulhi": "mul.hi.u32 t4, $4, 0x40000000;\n"},
}
_MASKS = ("and.b32 a1, t1, 0x81C081C0;\nand.b32 a2, t2, 0x81C081C0;\nand.b32 t3, t3, 0x80C080C0;\n"
          "and.b32 t4, t4, 0x01000100;\nor.b32 a3, t3, t4;\n")


def variant_ptx(left4: str, rot10: str, left6: str, right2: str) -> str:
    p = _PARTS
    return ("{\n" + _HEAD + p["left4"][left4] + p["rot10"][rot10] + p["left6"][left6] + p["right2"][right2]
            + _MASKS + _TAIL + "}")


VARIANTS = {
    "kernel": None,  # eg._FP4_PTX as it is
    "rot10-wide": variant_ptx("mul", "wide", "mul", "shr"),
    "all-fma": variant_ptx("mul", "wide", "mul", "mulhi"),
}
_KERNEL_PTX = eg._FP4_PTX


def use(name: str):
    eg._FP4_PTX = VARIANTS[name] or _KERNEL_PTX
    eg._build_kernel.cache_clear()
    jax.clear_caches()


def check_variant(name: str) -> bool:
    use(name)
    w = B.make_weight(jax.random.key(0), 8, 4608, 5120)
    x = jax.random.normal(jax.random.key(1), (6, 5120), jnp.bfloat16)
    gs = jnp.array([1, 1, 1, 1, 1, 1, 0, 0], jnp.int32)
    y = jax.jit(lambda x, p, g: eg.grouped_fp4_matmul(x, p, g))(x, eg.prepare_fp4_experts(w), gs)
    ok, _ = B.check(f"variant {name}", y, eg.expert_gemm_reference(x, w, gs))
    return ok


def time_variants(names, weights, e, rounds, budget_s, hbm):
    res = {}
    for _ in range(rounds):
        for name in names:
            use(name)
            for tokens, mat in ((1, "w13"), (1, "w2"), (8, "w13"), (8, "w2")):
                if B.elapsed() > budget_s:
                    B.log("budget reached: skipping", name, mat, tokens)
                    continue
                n, k, pw = weights[mat]
                cfg = eg.default_config(tokens * 6, n, k, e)
                routs = B.make_routings(jax.random.key(tokens), tokens, e, 6, 4, k)
                sets = []
                for x, gs, _ in routs:  # kf: the same kernel for every routing (their shapes agree)
                    kf, sched, src = B.kernel_only(x, pw, gs, cfg)
                    sets.append((*sched, jnp.take(x, src, axis=0, mode="fill", fill_value=0), pw.weight, pw.scale_t))
                c, _ = B.time_calls(kf, sets)
                gb = statistics.mean(u for _, _, u in routs) * n * (k // 2 + k // 32) / 1e9
                res.setdefault((mat, tokens, name), []).append((c * 1e6, 100 * gb / c / 1e3 / hbm))
                B.log(f"{name} {mat} T={tokens}: {c * 1e6:.2f} us ({res[(mat, tokens, name)][-1][1]:.1f}% of HBM)")
    return res


def moe_chain(weights, e, tokens, layers=8, rounds=2, reps=7):
    """Wall time a layer of `layers` MoE layers' routed experts in one program, with and without PDL."""
    from dsv41 import moe, quant
    from dsv41.config import preset

    cfg = dataclasses.replace(preset("bench"), n_routed_experts=e, n_activated_experts=6)
    p = {"w13": weights["w13"][2], "w2": weights["w2"][2]}
    x = jax.random.normal(jax.random.key(5), (tokens, cfg.dim), jnp.bfloat16)
    idxs = jnp.stack([jnp.argsort(jax.random.uniform(jax.random.key(100 + i), (tokens, e)), axis=-1)[:, :6]
                      for i in range(layers)]).astype(jnp.int32)
    ws = jax.random.uniform(jax.random.key(7), (layers, tokens, 6), jnp.float32, 0.1, 0.5)

    def stack(x, ws, idxs, p):
        for i in range(layers):
            x = moe.routed_experts(x, ws[i], idxs[i], p, cfg, quant.REFERENCE).astype(jnp.bfloat16)
        return x

    default = eg.default_config
    out = {}
    try:
        for _ in range(rounds):
            for pdl in (False, True):
                eg.default_config = lambda *a, _p=pdl: dataclasses.replace(default(*a), pdl=_p)
                eg._build_kernel.cache_clear()
                jax.clear_caches()
                fn = jax.jit(stack)
                y = jax.block_until_ready(fn(x, ws, idxs, p))
                walls = []
                for _ in range(reps):
                    t = time.perf_counter()
                    for _ in range(20):
                        y = fn(x, ws, idxs, p)
                    jax.block_until_ready(y)
                    walls.append((time.perf_counter() - t) / 20 / layers * 1e6)
                kern_us, count, _ = B.kernel_breakdown(fn, (x, ws, idxs, p))
                out.setdefault(pdl, []).append((statistics.median(walls), kern_us / layers))
                B.log(f"moe chain T={tokens} pdl={pdl}: wall {statistics.median(walls):.1f} us a layer, CUPTI "
                      f"{kern_us / layers:.1f} us a layer ({count} kernels), finite="
                      f"{bool(jnp.isfinite(y.astype(jnp.float32)).all())}")
    finally:
        eg.default_config = default
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {list(VARIANTS)}")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=300, help="stop timing variants past this many seconds")
    ap.add_argument("--moe-chain", action="store_true", help="also time 8 MoE layers with and without PDL")
    a = ap.parse_args()
    if jax.default_backend() != "gpu":
        sys.exit("bench_decode_variants times the Mosaic GPU kernel: it needs the H200 (device tool)")
    names = [n for n in a.variants.split(",") if n]
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        sys.exit(f"unknown variants {bad}: choose from {list(VARIANTS)}")
    names = [n for n in names if check_variant(n)]
    ceil = B.ceilings(quick=False)
    B.log(f"HBM {ceil['hbm_TBps']:.2f} TB/s")
    e = a.experts
    weights = {}
    for i, (mat, (n, k)) in enumerate({"w13": (4608, 5120), "w2": (5120, 2304)}.items()):
        weights[mat] = (n, k, eg.prepare_fp4_experts(B.make_weight(jax.random.key(10 + i), e, n, k)))
    res = time_variants(names, weights, e, a.rounds, a.budget_s, ceil["hbm_TBps"])
    chain = {}
    if a.moe_chain:
        use("kernel")
        chain = {t: moe_chain(weights, e, t) for t in (1, 8)}
    print(f"\nH200, HBM {ceil['hbm_TBps']:.2f} TB/s (PyTorch sum), {e} experts, top-6, the kernel alone (CUPTI)")
    print(f"{'case':<12}{'variant':<14}{'us by round':<30}{'median us':>10}{'% of HBM':>10}")
    for (mat, tokens, name), v in sorted(res.items()):
        med = statistics.median(u for u, _ in v)
        pct = statistics.median(p for _, p in v)
        print(f"{mat + ' T=' + str(tokens):<12}{name:<14}{' / '.join(f'{u:.2f}' for u, _ in v):<30}{med:>10.2f}"
              f"{pct:>10.1f}")
    for tokens, out in chain.items():
        for pdl, v in out.items():
            print(f"moe x8 T={tokens:<3} pdl={str(pdl):<6} wall us a layer {' / '.join(f'{w:.1f}' for w, _ in v):<16}"
                  f" CUPTI us a layer {' / '.join(f'{c:.1f}' for _, c in v)}")


if __name__ == "__main__":
    main()
