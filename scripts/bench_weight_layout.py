"""How fast TMA streams expert weights out of HBM, by how their bytes are laid out (no compute).

The grouped FP4 expert GEMM reads each work item's weights as boxes of [128 rows, 128 bytes] out of a row-major
[N, K/2] expert (rows 2560 bytes apart at K = 5120): one box is 128 separate 128-byte pieces. On the H200 the
kernel stays at 60-67% of HBM bandwidth at decode however many pipeline stages it has (4 or 8) and whatever its
decoder costs (the twelfth session cut the decoder's per-word integer work and the time did not move), so the
question is whether the access pattern itself caps it. This streams the same bytes with the same boxes, shared
memory transforms and pipeline depth through a Mosaic GPU pipeline whose body does nothing, from:

  rows   [R, Kb] row-major (today's layout): box [rows, B] at (item, k)
  tiles  [R/rows, Kb/B, rows, B]: each box one contiguous rows*B-byte block
  flat   the same contiguous blocks as boxes of 1 KB rows (uint32 [.., rows*B/1024, 256], no swizzle: what a
         copy of tiles stored already swizzled would be): does TMA stream faster in fewer, longer rows?
  ldg    no TMA: each item read by the threads of 1-4 warpgroups with 16-byte plain loads (`--ldg WGSxLOADS`,
         `WGSxLOADS:256` / `:128` with an L2 prefetch-size hint and no L1 allocation, `ld.global.nc.L1::no_allocate
         .L2::256B`)

On the H200 (2026-12-01, docs/PERFORMANCE.md "Twelfth session") the first three streamed 2.7-3.2 TB/s with the
decode's [128, 128 B] boxes, at 4 or 8 stages: the kernel's 2.84 TB/s is 90-95% of it. Boxes of 256 rows or of
256 bytes (`--box-rows 128,256 --box-bytes 128,256`; wider than 128 bytes is not swizzled) and the plain loads
were not run yet. The thirteenth session ran them: 2.5-3.2 TB/s for every box and 2.65-3.02 for the plain loads,
while XLA's own f32 sum reached 3.06-3.25 TB/s and only PyTorch's sum 4.2. Whether the loads' L2 prefetch size
is the difference is what the hinted plain loads (`--ldg 2x8,2x8:256,4x8:256`) measure.

    PYTHONPATH=. python3 scripts/bench_weight_layout.py [--gib 1.5] [--stages 4,8] [--box-bytes 128,64]
                                                        [--box-rows 128] [--ldg 1x4,2x4,2x8,4x8]
    PYTHONPATH=. python3 scripts/bench_weight_layout.py --items 33,66,99,132,198,216,264 [--stages 4,8]
    PYTHONPATH=. python3 scripts/bench_weight_layout.py --tiny    # CPU: the interpreter, toy sizes

`--items` asks another question: does one CTA's stream have a rate of its own? The expert GEMM at one token has
216 items of [128 rows, 2560 B] for 132 SMs, and its 84 second-wave SMs stream no faster than when all 132 are
busy (~24 GB/s each: docs/KERNELS_EXPERT_GEMM.md, "Twentieth session"), and deeper pipelines did not change that
(twenty-first). This times (CUPTI, the kernel alone, fresh bytes each call) one grid of that many items, a CTA an
item: if a CTA's rate is capped, 33 to 132 items take the same time and the total grows with the count; if HBM is
the cap, the time grows with the bytes.
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import time

import jax
import jax.numpy as jnp

log = logging.getLogger("bench_weight_layout")


@functools.lru_cache(maxsize=None)
def stream_kernel(layout: str, items: int, rows: int, kb: int, box: int, stages: int, interpret: bool):
    """A kernel over `items` work items of `rows` rows x kb bytes, each streamed as kb / box boxes of [rows, box]
    (swizzled as the expert GEMM's up to 128 bytes; wider boxes cannot be, and are not)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    steps = kb // box
    transforms = (plgpu.TilingTransform((8, box)), plgpu.SwizzleTransform(box)) if box <= 128 else ()
    flat_rows = rows * box // 1024  # a block as rows of 1 KB (256 uint32)

    def kernel(w_gmem, o_gmem):
        i = jax.lax.axis_index("i")
        if layout == "rows":
            ref = w_gmem.at[pl.ds(i * rows, rows)]
            spec = plgpu.BlockSpec((rows, box), lambda k: (0, k), transforms=transforms)
        elif layout == "tiles":
            ref = w_gmem.at[i]
            spec = plgpu.BlockSpec((None, rows, box), lambda k: (k, 0, 0), transforms=transforms)
        else:
            ref = w_gmem.at[i]
            spec = plgpu.BlockSpec((None, flat_rows, 256), lambda k: (k, 0, 0))

        def body(_, w_smem):
            del w_smem  # the bytes only have to land: the time is the transfer's

        plgpu.emit_pipeline(body, grid=(steps,), in_specs=[spec], max_concurrent_steps=stages)(ref)

        @pl.when(i == 0)
        def _():
            o_gmem[...] = jnp.zeros_like(o_gmem)

    shape = {"rows": (items * rows, kb), "tiles": (items, steps, rows, box),
             "flat": (items, steps, flat_rows, 256)}[layout]
    call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((8, 128), jnp.float32), grid=(items,),
                        grid_names=("i",), interpret=plgpu.InterpretGPUParams() if interpret else None)
    return jax.jit(call), shape


@functools.lru_cache(maxsize=None)
def ldg_kernel(items: int, rows: int, kb: int, wgs: int, unroll: int, hint: str = ""):
    """The same items read without TMA: every thread of `wgs` warpgroups streams 16-byte `ld.global.nc.v4` loads
    over its item's rows x kb bytes (contiguous in the row-major layout), `unroll` loads in flight, folding them
    into one word it stores at the end (so nothing is dead code). The plain-load ceiling of one CTA an item:
    what a producer of several warps with wide loads would fetch at (GPU only: the interpreter cannot run PTX).
    hint '256' / '128': each load also asks L2 to fetch 256 / 128 bytes around it and skips L1 (PyTorch's
    reductions read at 4.2 TB/s on the H200, JAX's at ~3.1-3.2)."""
    qualifiers = {"": "", "128": ".L1::no_allocate.L2::128B", "256": ".L1::no_allocate.L2::256B"}
    if hint not in qualifiers:
        raise ValueError(f"hint {hint!r}: one of {sorted(qualifiers)}")
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental.mosaic.gpu import utils as mu
    from jax.experimental.pallas import mosaic_gpu as plgpu

    threads = 128 * wgs
    item_bytes = rows * kb
    if item_bytes % (threads * 16 * unroll):
        raise ValueError(f"an item's {item_bytes} bytes are not whole rounds of {threads} x 16 x {unroll}")
    rounds = item_bytes // (threads * 16 * unroll)

    def fn(ctx, w_ref, o_ref):
        del ctx
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        tid, blk = mu.thread_idx(), mu.block_idx()
        base = arith.addi(llvm.ptrtoint(i64, mu.memref_ptr(w_ref)),
                          arith.muli(arith.extui(i64, blk), arith.constant(i64, item_bytes)))
        mine = arith.addi(base, arith.muli(arith.extui(i64, tid), arith.constant(i64, 16)))
        zero = arith.constant(i32, 0)

        @mu.fori(arith.constant(i32, rounds), [zero] * 4)
        def acc(r, carry):
            carry = list(carry)
            for u in range(unroll):
                step = arith.muli(arith.addi(arith.muli(r, arith.constant(i32, unroll)), arith.constant(i32, u)),
                                  arith.constant(i32, threads * 16))
                words = mu.inline_ptx(
                    "{ .reg .b64 g; cvta.to.global.u64 g, $4; "
                    f"ld.global.nc{qualifiers[hint]}.v4.b32 {{$0, $1, $2, $3}}, [g]; }}",
                    arith.addi(mine, arith.extui(i64, step)), result_types=[i32] * 4, has_side_effects=True)
                carry = [arith.xori(c, w) for c, w in zip(carry, words)]
            return carry

        folded = acc.results
        word = arith.xori(arith.xori(folded[0], folded[1]), arith.xori(folded[2], folded[3]))
        out = arith.addi(llvm.ptrtoint(i64, mu.memref_ptr(o_ref)),
                         arith.extui(i64, arith.muli(arith.addi(arith.muli(blk, arith.constant(i32, threads)), tid),
                                                     arith.constant(i32, 4))))
        mu.inline_ptx("{ .reg .b64 g; cvta.to.global.u64 g, $0; st.global.b32 [g], $1; }", out, word,
                      has_side_effects=True)
        return ()

    def kernel(w_gmem, o_gmem):
        plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))(fn)(w_gmem, o_gmem)

    call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((items * threads,), jnp.uint32), grid=(items,),
                        grid_names=("i",), num_threads=wgs, thread_name="wg")
    return jax.jit(call), (items * rows, kb)


def to_tiles(w: jax.Array, rows: int, box: int) -> jax.Array:
    r, kb = w.shape
    return w.reshape(r // rows, rows, kb // box, box).transpose(0, 2, 1, 3)


def to_flat(w: jax.Array, rows: int, box: int) -> jax.Array:
    t = to_tiles(w, rows, box)
    return jax.lax.bitcast_convert_type(t.reshape(*t.shape[:2], -1, 256, 4), jnp.uint32)


def median_ms(fn, arg, reps: int) -> float:
    jax.block_until_ready(fn(arg))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(arg))
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def cupti_us(fn, args: list, reps: int) -> float:
    """Median CUPTI time (us) of fn's one kernel, called on args[i % len(args)] (fresh bytes past the L2)."""
    from profile_step import cupti_kernels

    jax.block_until_ready(fn(args[0]))
    timings = cupti_kernels(lambda: jax.block_until_ready([fn(args[i % len(args)]) for i in range(reps)]))
    if len(timings) != reps:
        raise RuntimeError(f"expected {reps} kernel timings, got {len(timings)}")
    return statistics.median(ms for _, ms in timings) * 1e3


def item_sweep(counts: list[int], kb: int, rows: int, box: int, stages: list[int], reps: int) -> None:
    """One grid of n items (a CTA each) per count: time, total rate and each CTA's rate."""
    from pallas_kernels.expert_gemm import _num_sms

    per_item = rows * kb
    n_max = max(counts)
    # 16 copies: even 16 grids of the smallest count (16 x 33 x 327 KB = 173 MB) are far past the 50 MB L2
    copies = [jax.random.bits(jax.random.key(c), (n_max * rows, kb), jnp.uint8) for c in range(16)]
    print(f"{'items':>6} {'waves':>6} {'stages':>6} {'us':>8} {'TB/s':>6} {'GB/s a CTA':>11}  "
          f"(items of [{rows} rows, {kb} B], {box}-byte boxes)")
    for n in counts:
        args = [c[: n * rows] for c in copies]
        for st in stages:
            fn, shape = stream_kernel("rows", n, rows, kb, box, st, False)
            assert args[0].shape == shape
            us = cupti_us(fn, args, reps)
            print(f"{n:>6} {n / _num_sms():>6.2f} {st:>6} {us:8.2f} {n * per_item / us / 1e6:6.2f} "
                  f"{per_item / us / 1e3:11.1f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.5, help="bytes streamed per call (well past the 50 MB L2)")
    ap.add_argument("--k-bytes", type=int, default=2560, help="bytes of a weight row (K/2 for FP4; 5120 -> 2560)")
    ap.add_argument("--stages", default="4,8")
    ap.add_argument("--box-bytes", default="128,64", help="box widths (the kernel's tk/2: decode 128, prefill 64)")
    ap.add_argument("--box-rows", default="128", help="rows of a box and of a work item (the kernel's: 128)")
    ap.add_argument("--ldg", default="", help="also the plain-load stream: warpgroups x loads in flight a "
                                              "thread[:L2 prefetch bytes], e.g. 1x4,2x4,4x8,2x8:256 (GPU only)")
    ap.add_argument("--items", default="", help="instead: grids of these many items (CUPTI; GPU only)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.items:
        item_sweep([int(n) for n in args.items.split(",")], args.k_bytes, int(args.box_rows.split(",")[0]),
                   int(args.box_bytes.split(",")[0]), [int(s) for s in args.stages.split(",")], max(args.reps, 40))
        return
    interpret = args.tiny
    kb = 256 if args.tiny else args.k_bytes
    max_rows = max(map(int, args.box_rows.split(",")))
    items = 2 if args.tiny else int(args.gib * 2**30 // (max_rows * kb))
    nbytes = items * max_rows * kb
    w = jax.random.bits(jax.random.key(0), (items * max_rows, kb), jnp.uint8)
    if not args.tiny:
        from bench_engine import measure_hbm

        log.info("HBM (XLA f32 scale, read + write): %.2f TB/s", measure_hbm() / 1e12)
    print(f"{'layout':>6} {'rows':>5} {'box B':>6} {'stages':>6} {'ms':>8} {'TB/s':>6}  ({nbytes / 1e9:.2f} GB "
          f"of rows of {kb} B)")
    for rows in map(int, args.box_rows.split(",")):
        n_items = items * max_rows // rows
        for box in map(int, args.box_bytes.split(",")):
            tiles, flat = to_tiles(w, rows, box), to_flat(w, rows, box)
            for stages in map(int, args.stages.split(",")):
                for layout, arg in (("rows", w), ("tiles", tiles), ("flat", flat)):
                    fn, shape = stream_kernel(layout, n_items, rows, kb, box, stages, interpret)
                    assert arg.shape == shape, (arg.shape, shape)
                    try:
                        ms = median_ms(fn, arg, 1 if args.tiny else args.reps)
                    except ValueError as e:  # e.g. the stages' boxes exceed shared memory
                        print(f"{layout:>6} {rows:>5} {box:>6} {stages:>6}  skipped: {str(e)[:90]}", flush=True)
                        continue
                    print(f"{layout:>6} {rows:>5} {box:>6} {stages:>6} {ms:8.3f} {nbytes / ms / 1e9:6.2f}", flush=True)
        for spec in filter(None, args.ldg.split(",")):
            shape_spec, _, hint = spec.partition(":")
            wgs, unroll = map(int, shape_spec.split("x"))
            fn, shape = ldg_kernel(n_items, rows, kb, wgs, unroll, hint)
            ms = median_ms(fn, w, args.reps)
            name = "ldg" + (f"/{hint}" if hint else "")
            print(f"{name:>6} {rows:>5} {f'{wgs}wg':>6} {f'x{unroll}':>6} {ms:8.3f} {nbytes / ms / 1e9:6.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
