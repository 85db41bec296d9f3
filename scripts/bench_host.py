"""The engine's host time per decode step, by function: `Engine.step` with its programs stubbed (each call returns
outputs made once, so nothing runs on the device and nothing waits for it), B running requests at a context of
--decode-ctx, greedy (--temperature > 0: the sampling program runs too). What is left is Python and numpy on the host: reading the previous tokens back and accepting
them, admission, pages, the batch arrays (of them the Engram rows: hashing and the host table gather), the sampling
arrays, and handing the outputs on. Each function's own time (its callees' taken out), microseconds a step.

    PYTHONPATH=. python3 scripts/bench_host.py [--preset tiny] [--batches 1,8,64] [--steps 300] [--device-feed]

--device-feed: each batch also with its tokens fed on the device (`EngineConfig.device_feed`: no Engram hashing or
gather on the host; the step dispatched before the previous one's tokens are read).

The step's share the device sees is this plus the program's dispatch (`bench_engine.py`: engine step against
device-only). Any machine: the CPU's numbers are this host's Python; on a GPU host, its own.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time

from timing import device_params, engine_args, fake_decode_state, make_engine, print_table, write_json  # noqa: I001
import jax
import jax.numpy as jnp

from dsv41.config import preset

log = logging.getLogger("bench_host")

# Engine methods a decode step calls, in call order (nesting: _decode_batch calls _batch, which calls _rows
# (Engram), and _sampling; _dispatched calls _read with synchronous scheduling)
PARTS = ("step", "_read", "_admit", "_decode", "_hold_pages", "_decode_rows", "_decode_batch", "_batch", "_rows",
         "_sampling", "_drawn", "_dispatched")
# with the tokens fed on the device, in place of _decode_batch and _rows (device_feed.py)
FED_PARTS = ("_fed_batch", "_dispatched_fed", "_fed_read")


class _Stub:
    """The engine's programs with the decode step's (`Engine.run_decode`) answering at once (the pool unchanged,
    logits and tokens made once)."""

    def __init__(self, programs, rows: int, vocab: int):
        self._programs = programs
        self._logits = jnp.zeros((rows, vocab), jnp.float32)
        self._tok = jnp.full((rows,), 7, jnp.int32)

    def __getattr__(self, name):
        return getattr(self._programs, name)

    def run_full(self, params, pool, batch, **static):
        return pool, self._logits, self._tok

    def run_decode_first(self, params, pool, batch, **static):
        return pool, None, None

    def run_decode_rest(self, params, pool, batch, h, pre, **static):
        return pool, self._logits, self._tok


class Attribution:
    """Own time of wrapped callables (a callee's time is taken out of its caller's)."""

    def __init__(self):
        self.own = collections.defaultdict(float)
        self._stack: list[float] = []

    def wrap(self, name: str, fn):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            self._stack.append(0.0)
            try:
                return fn(*args, **kw)
            finally:
                dt = time.perf_counter() - t0
                self.own[name] += dt - self._stack.pop()
                if self._stack:
                    self._stack[-1] += dt

        return timed


def host_step(eng, B: int, ctx: int, steps: int, temperature: float = 0.0, fed: bool = False) -> dict:
    """-> {'step_us': median wall time of a step (unwrapped), part: own us a step (wrapped run)}. temperature > 0:
    every row draws, so each step also runs the sampling program (on the device, not stubbed). fed: the engine's
    device feed on (an engine built with it), else the synchronous loop."""
    eng._in_flight.clear()
    eng.device_feed, eng.async_scheduling = fed, fed
    fake_decode_state(eng, B, ctx, temperature)
    rows = len(eng._decode_rows(list(eng.running.values())))
    programs, att, walls = eng.programs, Attribution(), []
    eng.programs = _Stub(programs, rows, eng.cfg.vocab_size)
    try:
        for _ in range(10):
            eng.step()
        for _ in range(steps):
            t0 = time.perf_counter()
            eng.step()
            walls.append(time.perf_counter() - t0)
        for name in PARTS + FED_PARTS:
            setattr(eng, name, att.wrap(name, getattr(eng, name)))
        for _ in range(steps):
            eng.step()
    finally:  # the engine as it was: its own programs and methods
        for name in PARTS + FED_PARTS:
            vars(eng).pop(name, None)
        eng.programs = programs
    return {"step_us": statistics.median(walls) * 1e6, **{k: v / steps * 1e6 for k, v in att.own.items()}}


def main():
    ap = engine_args(__doc__, batches="1,8,64", weights=False)
    ap.set_defaults(preset="tiny")
    ap.add_argument("--steps", type=int, default=300, help="steps timed (and as many attributed)")
    ap.add_argument("--device-feed", action="store_true", help="each batch also with its tokens fed on the device")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = preset(args.preset)
    batches = [int(b) for b in args.batches.split(",")]
    eng = make_engine(cfg, device_params(cfg), True, args.decode_ctx + 4 * args.steps, max(batches),
                      device_feed=args.device_feed)
    results = []
    for B in batches:
        for fed in (False, True) if args.device_feed else (False,):
            r = host_step(eng, B, args.decode_ctx, args.steps, args.temperature, fed)
            results.append({"batch": B, "loop": "fed" if fed else "sync", **r})
            log.info("batch %d %s: host step %.0f us", B, results[-1]["loop"], r["step_us"])
    dev = jax.devices()[0]
    print(f"\n{dev.device_kind} host, jax {jax.__version__}, {args.preset} preset ({len(cfg.engram_layer_ids)} Engram "
          f"layers), context {args.decode_ctx}: a decode step's host time, us (each function's own; median step "
          f"unwrapped, the parts from a wrapped run of {args.steps} steps)\n")
    parts = [p for p in PARTS + FED_PARTS if any(p in r for r in results)]
    print_table(["batch", "loop", "host step", *parts],
                [[r["batch"], r["loop"], f"{r['step_us']:.0f}", *(f"{r.get(p, 0.0):.0f}" for p in parts)]
                 for r in results])
    write_json(args.out, "bench_host.json", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
