"""scripts/trace_expert_gemm.py reads the traces Mosaic GPU's on-device profiler writes: a profile buffer built by
hand (two CTAs, one and two work items) goes through the profiler's own `ProfilerSpec.dump`, and the summary
must give back the durations the buffer holds."""

import io
import json
import os
import sys

import numpy as np
from pytest import approx
from jax.experimental.mosaic.gpu import profiler

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import trace_expert_gemm as te  # noqa: E402

STEP, GAP, SEAM_IN, STORE, SEAM_OUT, FILL = 1100, 180, 60, 250, 700, 5000


def _cta_events(n_items: int, steps: int) -> list[tuple[str, int, int]]:
    """(name, begin cycle, end cycle) of one compute warpgroup: cta > item > step > decode / wait, store."""
    ev, t = [("cta", 0, None)], FILL - 40
    for i in range(n_items):
        item0 = t
        t += 40
        for _ in range(steps):
            # decode one cycle after its step: the dump's estimate of the profiler's cost per event (the smallest
            # step between two events, less one) is then 0 and leaves the durations as written
            ev += [("step", t, t + STEP), ("decode", t + 1, t + 591), ("wait", t + 990, t + 1090)]
            t += STEP + GAP
        t -= GAP
        ev.append(("item", item0, t + SEAM_IN))
        t += SEAM_IN + 1
        ev.append(("store", t, t + STORE))
        t += STORE + SEAM_OUT - 1
    ev[0] = ("cta", 0, t)
    return ev


def _buffer(spec, ctas: list[list[tuple[str, int, int]]], wgs: int, start_ns: list[int]) -> np.ndarray:
    entries = spec.entries_per_warpgroup
    buf = np.zeros((len(ctas), wgs, entries), np.uint32)
    for b, ev in enumerate(ctas):
        marks = sorted([(t0, 0, -t1, n) for n, t0, t1 in ev] + [(t1, 1, -t0, n) for n, t0, t1 in ev],
                       key=lambda m: (m[0], m[1] if m[1] else 2, m[2]))
        for wg in range(wgs):
            rec = []
            for t, is_end, _, name in marks:
                rec += [spec.intern_name(name) | (profiler.ProfilerSpec.EXIT if is_end else 0), 1000 + t]
            buf[b, wg, :3] = (start_ns[b], 7 + b, len(rec))
            buf[b, wg, 3:3 + len(rec)] = rec
    return buf.reshape(-1)


def test_summary_of_a_dumped_trace():
    spec = profiler.ProfilerSpec(4 * te.TRACE_RANGES)
    ctas = [_cta_events(1, 4), _cta_events(2, 4)]
    f = io.StringIO()
    spec.dump(_buffer(spec, ctas, 3, [10_000, 10_500]), f, grid=(2,), block=(384,))
    per = te.per_cta(te.regions(json.loads(f.getvalue())), traces_per_block=3)
    assert [(c["sm"], c["items"], c["steps"]) for c in per] == [(7, 1, 4), (8, 2, 8)]
    for c in per:
        assert (c["fill"], c["setup"], c["head0"]) == approx((FILL, FILL - 40, 40))  # ts: float microseconds
        assert (c["step"], c["gap"], c["wait"], c["decode"], c["store"]) == approx((STEP, GAP, 100, 590, STORE))
    two = per[1]
    assert (two["seam"], two["tail"], two["head"]) == approx((SEAM_IN + STORE + SEAM_OUT + 40, SEAM_IN, 40))
    rows = te.summarise(per, ghz=2.0)
    assert [(r["items"], r["ctas"]) for r in rows] == [(1, 1), (2, 1)]
    assert (rows[0]["start_med"], rows[1]["start_med"]) == approx((0.0, 0.5))  # us after the first CTA
    assert rows[1]["end_med"] == approx(0.5 + two["cta"] / 2.0 / 1e3)
