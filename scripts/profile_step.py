"""Where an engine step's device time goes: every kernel a decode step (or a prefill) launches, CUPTI-timed and
summed by kind (our kernels by name, XLA's GEMMs, other fusions), against the step's wall time ("gap": launches,
host work, idle). Bench preset (Flash widths, 8 layers), GPU only.

    PYTHONPATH=. python3 scripts/profile_step.py --backend auto --batches 1,64 --prefill 8192 [--out DIR]

--speculative K: the decode step is DSpark's verify + draft step (k = K, forced acceptance, the 3 stages at Flash's
widths), as `--speculative-config '{"method": "dspark", "num_speculative_tokens": K}'` serves it.
The first decode batch's kernels are also summed by model part (`mhc`, `attention`, `moe/router`, ...): the named
scopes of the compiled program's HLO matched to CUPTI's kernel names (cuBLAS kernels count as "unmatched").

--timeline: each decode batch's steps are also traced (jax.profiler) and placed on one clock: per step, the GPU's
busy time and its idle gaps, which kernel each long gap waits for, and the host thread's time per event name. A gap
the host does not fill means the device waits for launches; a step whose dispatch does not return before the
device is done holds the host (a device-to-host read inside the program). One batch size a run.

--device-feed: the decode steps fed on the device (`EngineConfig.device_feed`: each dispatched before the host reads
the one before), timed as loops closed by the read of what the last step left in flight; the timeline's steps run
that way too.
"""

from __future__ import annotations

import argparse
import collections
import glob
import logging
import os
import re
import sys
import tempfile
import time

from timing import KERNELS, cupti_kernels, device_params, fake_decode_state  # noqa: I001 (first: sys.path)
from timing import engine_args, make_engine, median_wall_s as timed, model_config, print_table, with_fp4_experts
from timing import write_json
import jax

from dsv41 import params as P
from serving.engine.config import SpeculativeConfig
from serving.engine.engine import SamplingParams

log = logging.getLogger("profile_step")

OUR_KERNELS = ("expert_gemm_fp4", "fp8_linear", "sparse_attention", "indexer_logits", "kv_write_decode", "mhc_site",
               "router_scores", "router_topk")
GEMM_MARKS = ("gemm", "xmma", "nvjet", "cutlass", "matmul", "cublas")


def kind_of(name: str) -> str:
    for k in OUR_KERNELS:
        if k in name:
            return f"pallas {k}"
    low = name.lower()
    if any(m in low for m in GEMM_MARKS):
        return "XLA GEMM (cuBLAS / Triton)"
    if "topk" in low or "sort" in low:
        return "XLA top-k / sort"
    return "XLA other (fusions, copies, scatters)"


_HLO_OP = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = .*?metadata=\{op_name="([^"]*)"', re.MULTILINE)
_LAYER = re.compile(r"layer\d+")
AMBIGUOUS = "(a kernel name of several parts)"


def hlo_parts(hlo_texts: list[str]) -> dict[str, str]:
    """Compiled HLO texts (a step's programs) -> {kernel name: model part}: an instruction's name with '.' and '-'
    as '_' (how XLA names the kernel of a fusion) and the named scopes of its op_name, jit(...) levels dropped. A
    name two programs give to kernels of different parts counts as AMBIGUOUS (CUPTI's kernel names do not say
    which program ran them)."""
    out = {}
    for text in hlo_texts:
        for name, op in _HLO_OP.findall(text):
            scopes = [p for p in op.split("/")[:-1] if not p.startswith("jit(") and not _LAYER.fullmatch(p)]
            name, part = re.sub(r"[.\-]", "_", name), "/".join(scopes) or "(top level)"
            out[name] = part if out.get(name, part) == part else AMBIGUOUS
    return out


def by_part(kernels: list[tuple[str, float]], parts: dict[str, str]) -> dict[str, tuple[int, float]]:
    """{part: (kernels, ms)}; our Mosaic kernels count under their own names, the rest by `hlo_parts`."""
    out = collections.defaultdict(lambda: [0, 0.0])
    for name, ms in kernels:
        part = next((f"pallas {k}" for k in OUR_KERNELS if k in name), None) or parts.get(name, "unmatched")
        out[part][0] += 1
        out[part][1] += ms
    return {k: (n, ms) for k, (n, ms) in out.items()}


def recording(progs, names: tuple[str, ...]):
    """Wraps each progs.<name> to keep its last call's argument shapes and keywords; -> a function giving those
    calls' compiled HLO texts (the pool is donated, so the arrays themselves are gone after the call)."""
    seen = {}

    def record(name):
        f = getattr(progs, name)

        def rec(*args, **kw):
            shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x  # noqa: E731
            seen[name] = jax.tree_util.tree_map(shape, args), kw
            return f(*args, **kw)

        setattr(progs, name, rec)
        return f

    fns = {name: record(name) for name in names}
    return lambda: [fns[n].lower(*seen[n][0], **seen[n][1]).compile().as_text() for n in names]


def summarize(label: str, wall_ms: float, kernels: list[tuple[str, float]], top: int) -> dict:
    by_kind, by_name = collections.defaultdict(float), collections.defaultdict(lambda: [0.0, 0])
    for name, ms in kernels:
        by_kind[kind_of(name)] += ms
        by_name[name][0] += ms
        by_name[name][1] += 1
    total = sum(by_kind.values())
    print(f"\n### {label}: wall {wall_ms:.2f} ms, {len(kernels)} kernels, kernel time {total:.2f} ms, "
          f"gap {wall_ms - total:.2f} ms\n")
    print_table(["kind", "ms", "of kernel time", "of wall"], [
        [k, f"{ms:.3f}", f"{100 * ms / total:.0f}%", f"{100 * ms / wall_ms:.0f}%"]
        for k, ms in sorted(by_kind.items(), key=lambda kv: -kv[1])]
        + [["gap (launches, host, idle)", f"{wall_ms - total:.3f}", "", f"{100 * (wall_ms - total) / wall_ms:.0f}%"]])
    print()
    print_table(["top kernels by time", "calls", "ms", "us / call"], [
        [f"`{name[:90]}`", n, f"{ms:.3f}", f"{1e3 * ms / n:.1f}"]
        for name, (ms, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]])
    return {"label": label, "wall_ms": wall_ms, "kernel_ms": total, "by_kind": dict(by_kind), "kernels": kernels}


def timeline(xplane: str, steps: int, top: int = 12) -> dict:
    """A jax.profiler trace of `steps` decode steps -> the GPU's busy time and idle gaps a step (between the first
    kernel's start and the last one's end), the gaps by the kind of kernel they wait for, the longest gaps with
    the kernels around them, and the host's busiest event names; printed as tables."""
    pd = jax.profiler.ProfileData.from_file(xplane)
    gpu = [p for p in pd.planes if p.name.startswith("/device:GPU")]
    log.info("trace planes %s; GPU lines %s", [p.name for p in pd.planes], [ln.name for p in gpu for ln in p.lines])
    kernels = sorted((e.start_ns, e.end_ns, e.name) for p in gpu for ln in p.lines if ln.name.startswith("Stream")
                     for e in ln.events)
    if not kernels:
        log.warning("no kernels in the trace")
        return {}
    gaps, longest = collections.defaultdict(lambda: [0, 0.0]), []
    busy, end = 0.0, kernels[0][0]
    for i, (k0, k1, name) in enumerate(kernels):
        if k0 > end:
            g = (k0 - end) / 1e3
            gaps[kind_of(name)][0] += 1
            gaps[kind_of(name)][1] += g
            longest.append((g, kernels[i - 1][2], name))
        busy += max(0, k1 - max(k0, end)) / 1e3
        end = max(end, k1)
    span = (end - kernels[0][0]) / 1e3
    idle = span - busy
    print()
    print_table(["steps", "kernels / step", "span us / step", "GPU busy us / step", "idle us / step", "idle"],
                [[steps, f"{len(kernels) / steps:.0f}", f"{span / steps:.0f}", f"{busy / steps:.0f}",
                  f"{idle / steps:.0f}", f"{100 * idle / span:.0f}%"]])
    print()
    print_table(["gaps before a kernel of kind", "gaps / step", "us / step"],
                [[k, f"{c / steps:.0f}", f"{us / steps:.0f}"]
                 for k, (c, us) in sorted(gaps.items(), key=lambda kv: -kv[1][1])])
    print()
    print_table(["longest gaps us", "after", "before"],
                [[f"{g:.1f}", f"`{a[:60]}`", f"`{b[:60]}`"] for g, a, b in sorted(longest, reverse=True)[:top]], "rll")
    host = collections.defaultdict(lambda: [0, 0.0])
    for p in pd.planes:
        if p.name.startswith("/host"):
            for ln in p.lines:
                for e in ln.events:
                    if kernels[0][0] <= e.start_ns < end:
                        host[(ln.name[:30], e.name[:70])][0] += 1
                        host[(ln.name[:30], e.name[:70])][1] += e.duration_ns / 1e3
    print()
    print_table(["host thread", "event", "calls / step", "us / step"],
                [[f"`{t}`", f"`{e}`", f"{c / steps:.0f}", f"{us / steps:.0f}"]
                 for (t, e), (c, us) in sorted(host.items(), key=lambda kv: -kv[1][1])[:3 * top]], align="llrr")
    return {"span_us": span, "busy_us": busy, "gaps": dict(gaps), "longest": sorted(longest, reverse=True)[:50],
            "host": {f"{t} | {e}": v for (t, e), v in host.items()}}


def steps(eng, n: int) -> None:
    """n engine steps, then the read of whatever the last left in flight (a fed step's tokens)."""
    for _ in range(n):
        eng.step()
    eng._read()


def traced(fn, reps: int) -> str:
    """Runs fn reps times under jax.profiler -> the trace's xplane file."""
    d = tempfile.mkdtemp(prefix="dsv41_trace")
    with jax.profiler.trace(d):
        for _ in range(reps):
            fn()
    return glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0]


def main():
    ap = engine_args(__doc__, batches="1,64")
    ap.add_argument("--backend", default="auto", choices=sorted(KERNELS))
    ap.add_argument("--prefill", type=int, default=8192, help="prompt tokens (0: no prefill profile)")
    ap.add_argument("--speculative", type=int, default=0, metavar="K", help="decode with DSpark, k = K (0: off)")
    ap.add_argument("--parts", action=argparse.BooleanOptionalAction, default=True,
                    help="the first batch's kernels by model part (compiles the program once more)")
    ap.add_argument("--timeline", action="store_true", help="also trace the decode steps: GPU idle gaps, host time")
    ap.add_argument("--device-feed", action="store_true",
                    help="decode steps fed on the device, each dispatched before the one before is read")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    if args.timeline and len(batches) > 1:
        ap.error("--timeline takes one batch size a run: Mosaic's CUPTI reader fails after a jax.profiler trace")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if jax.devices()[0].platform != "gpu":
        sys.exit("profile_step.py needs a GPU (CUPTI)")
    jax.config.update("jax_compilation_cache_dir", os.path.join(tempfile.gettempdir(), "dsv41_profile_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    cfg = model_config(args).replace(n_mtp_layers=3 if args.speculative else 0)
    params = device_params(cfg) if args.weights == "bf16" else P.init_params(cfg, seed=0)
    if args.weights == "bf16" and KERNELS[args.backend][1] != "xla":
        params = with_fp4_experts(params)
    jax.block_until_ready(params)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {args.preset} preset ({cfg.n_layers} layers, "
          f"{cfg.n_routed_experts} experts), kernels={args.backend}, weights={args.weights}, {time.strftime('%F')}")
    results = []
    if batches:
        max_len = -(-(args.decode_ctx + 256) // 64) * 64
        spec = SpeculativeConfig(num_speculative_tokens=args.speculative, forced_acceptance=True) \
            if args.speculative else None
        max_len += (args.speculative + 1) * 16
        eng = make_engine(cfg, params, True, max_len, max(batches), args.backend, speculative_config=spec,
                          scan_layers=args.scan_layers, device_feed=args.device_feed)
        # the step's programs (`Engine.run_decode`)
        names = tuple({"decode": "run_spec" if spec else "run_full"}.get(k, "run_" + k) for k in eng.decode_kinds)
        hlo = recording(eng.programs, names) if args.parts else None  # its tree_map costs ms a step
        # CUPTI reads a step's kernels once it returns: each step waits for its own (fed: `steps` closes the loop)
        eng.async_scheduling = args.device_feed
        for j, B in enumerate(batches):
            fake_decode_state(eng, B, args.decode_ctx, args.temperature)
            steps(eng, 1)  # compile
            wall = timed(lambda: steps(eng, 10), reps=3) * 1e3 / 10
            kernels = cupti_kernels(lambda: steps(eng, 1))
            what = f"DSpark verify + draft step (k={args.speculative})" if spec else "decode step"
            results.append(summarize(f"{what}, batch {B}, context {args.decode_ctx}", wall, kernels, 20))
            if j == 0 and args.parts:
                parts = by_part(kernels, hlo_parts(hlo()))
                total = sum(ms for _, ms in parts.values())
                print()
                print_table(["model part", "kernels", "ms", "of kernel time"], [
                    [k, n, f"{ms:.3f}", f"{100 * ms / total:.0f}%"]
                    for k, (n, ms) in sorted(parts.items(), key=lambda kv: -kv[1][1])])
                results[-1]["by_part"] = parts
            if args.timeline:
                print(f"\n### timeline of 5 steps, batch {B}")
                results[-1]["timeline"] = timeline(traced(lambda: steps(eng, 5), 1), 5)
        del eng
    if args.prefill:
        n = args.prefill
        eng = make_engine(cfg, params, True, -(-(n + 2048) // 64) * 64, 2, args.backend, scan_layers=args.scan_layers)
        run = lambda: eng.generate(list(range(3, 3 + n)), SamplingParams(max_tokens=1))  # noqa: E731
        run()  # compile
        wall = timed(run, reps=3) * 1e3
        results.append(summarize(f"prefill of {n} tokens (replay, chunks of 2048)", wall, cupti_kernels(run), 20))
    write_json(args.out, "profile_step.json", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
