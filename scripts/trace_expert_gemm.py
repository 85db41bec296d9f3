#!/usr/bin/env python3
"""Where one call of the FP4 expert GEMM spends its time, SM by SM, from Mosaic GPU's on-device trace.

On the H200 (device tool):  PYTHONPATH=. PYTHONUNBUFFERED=1 python3 scripts/trace_expert_gemm.py --out $OUT
On a CPU: nothing to trace (the trace is the GPU kernel's); `--parse FILE` summarises a trace written before.

For each case (tokens x weight x config) it times the kernel by CUPTI without the trace, then runs it with
`KernelConfig.trace_dir` (each warpgroup of each CTA records its named regions: cta, item, step, decode, wait,
store; `pallas_kernels/expert_gemm.py`) and prints, per group of SMs with the same number of work items:
  - start: when the CTA began, after the first CTA (global timer, us);
  - fill: from the CTA's start to its first step's start (the pipeline's first loads);
  - step / decode / wait: a pipeline step's compute (the decode of its weights, the wait for its wgmma);
  - gap: between one step's end and the next one's start within an item (the consumer waiting for the data);
  - store: an item's epilogue; seam: between an item's last step and the next item's first (store included);
  - cta: the compute warpgroup's whole time, and end = start + cta (us, at the SM clock given).
Cycles are the SM clock (%clock); us converts them at --clock-ghz (default: nvidia-smi's SM clock right after
the runs, or the maximum clock if the GPU has already dropped to idle). The regions cost a shared-memory store
each, which the profiler's dump takes out of each warpgroup's timeline by its own estimate (~9 cycles an event
on the H200): the traced call is still ~8% slower than the CUPTI time printed beside it, and a warpgroup with
few events (the TMA warpgroup) keeps its uncorrected, later timeline. `--hold-s S` also runs each case untraced
back to back for S seconds while nvidia-smi samples the SM clock, power and throttle reasons (the H200 held 1980
MHz with no reason under one-token calls, twenty-fifth session: the cycles convert at the maximum clock).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pallas_kernels.expert_gemm import TRACE_RANGES  # noqa: E402


def regions(trace: dict) -> dict[int, dict]:
    """Perfetto trace -> {trace id: {'sm', 'start_ns', 'regs': [(name, t0_cycles, t1_cycles)]}}. The profiler
    writes ts = (global timer at the CTA's start in ns + SM clock cycles since the trace's first event) / 1e3."""
    out: dict[int, dict] = {}
    stacks: dict[int, list] = {}
    for ev in trace["traceEvents"]:
        tid = ev["tid"]
        t = out.setdefault(tid, {"sm": ev["pid"] - 1, "start": ev["ts"], "regs": []})
        ts = (ev["ts"] - t["start"]) * 1e3
        st = stacks.setdefault(tid, [])
        if ev["ph"] == "B":
            st.append((ev["name"], ts))
        else:
            name, t0 = st.pop()
            t["regs"].append((name, t0, ts))
    for t in out.values():
        t["start_ns"] = t.pop("start") * 1e3
        t["regs"].sort(key=lambda r: r[1])
    return out


def per_cta(tr: dict[int, dict], traces_per_block: int, wg: int = 0) -> list[dict]:
    """Per CTA, from its compute warpgroup `wg`: items, steps, and the durations described in the module doc."""
    ctas = []
    for tid, t in sorted(tr.items()):
        if (tid - 1) % traces_per_block != wg:
            continue
        regs = t["regs"]
        by = lambda n: [r for r in regs if r[0] == n]
        cta, items, steps = by("cta"), by("item"), by("step")
        if not cta or not steps:
            continue
        c0 = cta[0][1]
        gaps, seams, tails, heads = [], [], [], []
        for it_i, it in enumerate(items):
            its = [s for s in steps if it[1] <= s[1] <= it[2]]
            gaps += [b[1] - a[2] for a, b in zip(its, its[1:])]
            if its:
                tails.append(it[2] - its[-1][2])  # last step's end -> the item's pipeline returns
                heads.append(its[0][1] - it[1])  # the item's pipeline starts -> its first step
            if it_i + 1 < len(items):
                nxt = [s for s in steps if items[it_i + 1][1] <= s[1] <= items[it_i + 1][2]]
                if its and nxt:
                    seams.append(nxt[0][1] - its[-1][2])
        med0 = lambda v: statistics.median(v) if v else 0.0
        lengths = lambda name: [r[2] - r[1] for r in by(name)]
        ctas.append(dict(
            sm=t["sm"], start_ns=t["start_ns"], items=len(items), steps=len(steps),
            fill=steps[0][1] - c0, cta=cta[0][2] - c0, step=med0(lengths("step")),
            decode=sum(lengths("decode")) / len(steps),  # a step's decode regions together (one a K half)
            wait=med0(lengths("wait")), gap=med0(gaps), seam=med0(seams), store=med0(lengths("store")),
            # the fill split: the CTA's start -> its first item's pipeline (set-up, the schedule's loads), and
            # that pipeline's start -> its first step (the first stage's data); tail / head: an item's pipeline
            # around its steps (their sum plus the store and the loop between them is the seam)
            setup=items[0][1] - c0 if items else 0.0, head0=heads[0] if heads else 0.0,
            tail=med0(tails), head=med0(heads[1:]),
            truncated=len(regs) >= TRACE_RANGES - 1, regs=regs if len(ctas) < 4 else None))
    return ctas


def summarise(ctas: list[dict], ghz: float) -> list[dict]:
    t0 = min(c["start_ns"] for c in ctas)
    rows = []
    for n_items in sorted({c["items"] for c in ctas}):
        g = [c for c in ctas if c["items"] == n_items]
        med = lambda key: statistics.median(c[key] for c in g)
        starts = [(c["start_ns"] - t0) / 1e3 for c in g]
        ends = [(c["start_ns"] - t0) / 1e3 + c["cta"] / ghz / 1e3 for c in g]
        rows.append(dict(items=n_items, ctas=len(g), steps=med("steps"), start_med=statistics.median(starts),
                         start_max=max(starts), fill=med("fill"), setup=med("setup"), head0=med("head0"),
                         step=med("step"), decode=med("decode"), wait=med("wait"), gap=med("gap"),
                         seam=med("seam"), tail=med("tail"), head=med("head"), store=med("store"), cta=med("cta"),
                         end_med=statistics.median(ends), end_max=max(ends),
                         truncated=sum(c["truncated"] for c in g)))
    return rows


def print_rows(title: str, rows: list[dict], ghz: float):
    print(f"\n{title}")
    hdr = (f"{'items':>5}{'ctas':>5}{'steps':>6}{'start us':>10}{'(max)':>7}{'fill cyc':>9}{'=setup':>7}{'+head':>6}"
           f"{'step':>6}{'decode':>7}{'wait':>5}{'gap':>5}{'seam':>6}{'tail':>5}{'store':>6}{'head':>5}"
           f"{'cta cyc':>8}{'end us':>8}{'(max)':>7}")
    print(hdr)
    for r in rows:
        print(f"{r['items']:>5}{r['ctas']:>5}{r['steps']:>6.0f}{r['start_med']:>10.2f}{r['start_max']:>7.2f}"
              f"{r['fill']:>9.0f}{r['setup']:>7.0f}{r['head0']:>6.0f}{r['step']:>6.0f}{r['decode']:>7.0f}"
              f"{r['wait']:>5.0f}{r['gap']:>5.0f}{r['seam']:>6.0f}{r['tail']:>5.0f}{r['store']:>6.0f}{r['head']:>5.0f}"
              f"{r['cta']:>8.0f}{r['end_med']:>8.2f}{r['end_max']:>7.2f}"
              + (f"  ({r['truncated']} truncated)" if r["truncated"] else ""))


def sm_clock_ghz() -> float | None:
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
        now, top = (float(v) / 1e3 for v in q.stdout.split("\n")[0].split(","))
        return now if now > 0.8 * top else top  # idle already (345 MHz on the H200): the clock under load is the top
    except Exception:  # noqa: BLE001
        return None


def hold(call, a, seconds: float) -> dict:
    """Run call(*a) back to back for `seconds` while nvidia-smi samples every 20 ms -> the samples' medians."""
    import jax

    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
                            "--format=csv,noheader,nounits", "-lms", "20"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.2)
    t0, n = time.time(), 0
    while time.time() - t0 < seconds:
        for _ in range(50):
            out = call(*a)
            n += 1
        jax.block_until_ready(out)
    smi.terminate()
    lines = [ln.split(",") for ln in smi.communicate()[0].splitlines() if ln.count(",") == 2]
    lines = lines[len(lines) // 4:]  # the load's samples, past nvidia-smi's start
    med = lambda i: statistics.median(float(ln[i]) for ln in lines) if lines else float("nan")
    return {"calls": n, "mhz": med(0), "watts": med(1), "reasons": sorted({ln[2].strip() for ln in lines})}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--mats", default="w13,w2")
    ap.add_argument("--configs", default="", help="configs as bench_expert_gemm's --decode-configs (default: "
                                                   "default_config's); a config that does not fit a weight is skipped")
    ap.add_argument("--nodecode", action="store_true", help="also each config without its decode (timing only)")
    ap.add_argument("--clock-ghz", type=float, default=0.0)
    ap.add_argument("--hold-s", type=float, default=0.0, help="also run each case untraced back to back for this "
                    "long while nvidia-smi samples the SM clock and power (is the clock lower under load?)")
    ap.add_argument("--parse", default="", help="summarise this trace file (no GPU)")
    ap.add_argument("--compute-wgs", type=int, default=2, help="with --parse: the kernel's compute warpgroups")
    args = ap.parse_args()
    if args.parse:
        with open(args.parse) as fh:
            tr = regions(json.load(fh))
        ghz = args.clock_ghz or 1.98
        print_rows(args.parse, summarise(per_cta(tr, args.compute_wgs + 1), ghz), ghz)
        return

    import jax
    import jax.numpy as jnp

    import bench_expert_gemm as beg
    from pallas_kernels import expert_gemm as eg

    beg.log("jax", jax.__version__, jax.devices())
    e, topk = 384, 6
    shapes = {"w13": (4608, 5120), "w2": (5120, 2304)}
    user_cfgs = beg.parse_configs(args.configs)
    results = []
    for mat in args.mats.split(","):
        n, k = shapes[mat]
        pw = eg.prepare_fp4_experts(beg.make_weight(jax.random.key(10), e, n, k))
        for tokens in (int(t) for t in args.tokens.split(",")):
            x, gs, uniq = beg.make_routings(jax.random.key(tokens), tokens, e, topk, 1, k)[0]
            cfgs = user_cfgs or [eg.default_config(tokens * topk, n, k, e)]
            cfgs = [c for c in cfgs if k % c.tk == 0 and n % c.tn == 0]
            if args.nodecode:
                cfgs = [v for c in cfgs for v in (c, dataclasses.replace(c, skip_decode=True))]
            for cfg in cfgs:
                name = f"{mat} T={tokens} {beg.label(cfg)}"
                try:
                    call, sched, src = beg.kernel_only(x, pw, gs, cfg)
                    xp = jnp.take(x, src, axis=0, mode="fill", fill_value=0)
                    a = (*sched, xp, pw.weight, pw.scale_t)
                    cupti, _ = beg.time_calls(call, [a])
                    d = tempfile.mkdtemp(prefix="trace_")
                    call_t, _, _ = beg.kernel_only(x, pw, gs, dataclasses.replace(cfg, trace_dir=d))
                    for _ in range(3):
                        jax.block_until_ready(call_t(*a))
                    jax.effects_barrier()  # the dump is a host callback
                    clocks = hold(call, a, args.hold_s) if args.hold_s else None
                    files = sorted(glob.glob(os.path.join(d, "*-trace.json")))
                    with open(files[-1]) as fh:
                        trace = json.load(fh)
                    ctas = per_cta(regions(trace), cfg.num_wgs + 1)
                    if args.out:
                        os.makedirs(os.path.join(args.out, "traces"), exist_ok=True)
                        shutil.copy(files[-1], os.path.join(args.out, "traces",
                                                            name.replace(" ", "_").replace("=", "") + ".json"))
                    results.append(dict(name=name, cupti_us=None if cupti is None else cupti * 1e6,
                                        experts=uniq, ctas=ctas, clocks=clocks))
                    beg.log(f"{name}: CUPTI {cupti * 1e6 if cupti else float('nan'):.1f} us, {len(ctas)} CTAs traced")
                except Exception as ex:  # noqa: BLE001
                    beg.log(f"{name}: FAILED {type(ex).__name__}: {str(ex)[:300]}")
    ghz = args.clock_ghz or sm_clock_ghz() or 1.98
    print(f"\nSM clock for the us columns: {ghz:.3f} GHz; cycles columns are medians over the CTAs of a row "
          "(compute warpgroup 0)")
    for r in results:
        rows = summarise(r["ctas"], ghz)
        r["rows"] = rows
        cupti = "no CUPTI time" if r["cupti_us"] is None else f"CUPTI {r['cupti_us']:.1f} us untraced"
        if r.get("clocks"):
            cupti += (f"; held {r['clocks']['calls']} calls: SM clock {r['clocks']['mhz']} MHz, "
                      f"{r['clocks']['watts']} W, throttle reasons {r['clocks']['reasons']}")
        print_rows(f"{r['name']}  ({cupti}, {r['experts']} experts)", rows, ghz)
    if args.out:
        with open(os.path.join(args.out, "trace_expert_gemm.json"), "w") as fh:
            json.dump({"ghz": ghz, "results": results, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "device": str(jax.devices())}, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
