"""The engine's decode loop with its tokens fed on the device (`EngineConfig.device_feed`: the next step dispatched
before the previous step's tokens are read, its Engram rows hashed and gathered in the program) against the
synchronous loop, async scheduling (the host reads each step's tokens before it builds the next) and the decode
program's calls queued back to back with nothing read between them (what the GPU alone needs a step: the bound).

    PYTHONPATH=. python3 scripts/bench_device_feed.py --batches 1,64 --decode-ctx 4096

One engine (device_feed on; the other loops switch it off, with the host tables and their own programs), B
requests at context --decode-ctx; per block each way runs --steps `Engine.step` calls from the same state (the
pool copied back), blocks alternated, medians. Checks that the fed loop gives the synchronous loop's tokens.
--temperature T > 0: every row draws (seeded), so each step also runs the sampling program.
Prints one table.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import jax

from timing import engine_args, fake_decode_state, make_engine, model_config, print_table  # noqa: I001 (sys.path)
from dsv41 import params as P

log = logging.getLogger("bench_device_feed")

WAYS = ("sync", "async", "fed")


def _set(eng, way: str, B: int, ctx: int, pool, temperature: float) -> None:
    """B fresh requests at ctx on a copy of `pool` (the rings and compressor states a run leaves behind are read
    by the next run's first steps: each way starts from the same state), nothing in flight, the loop of `way`."""
    eng._in_flight.clear()
    eng.pool = jax.tree_util.tree_map(lambda a: a.copy(), pool)
    fake_decode_state(eng, B, ctx, temperature)
    eng.device_feed = way == "fed"
    eng.async_scheduling = way != "sync"


def _loop(eng, steps: int) -> tuple[float, list[int]]:
    """-> (wall ms a step over `steps` steps and the read that ends them, request d0's tokens)."""
    toks = []
    t = time.perf_counter()
    for _ in range(steps):
        toks += [x for o in eng.step() if o.request_id == "d0" for x in o.new_token_ids]
    toks += [x for o in eng._read() if o.request_id == "d0" for x in o.new_token_ids]
    return (time.perf_counter() - t) / steps * 1e3, toks


def measure(eng, B: int, ctx: int, steps: int, blocks: int, temperature: float = 0.0) -> dict:
    """-> {way: median ms a step} with "queued" (the decode program back to back), and the first steps' s."""
    first = {}
    pool = jax.tree_util.tree_map(lambda a: a.copy(), eng.pool)
    for way in WAYS:  # compiles each way's programs
        _set(eng, way, B, ctx, pool, temperature)
        t = time.perf_counter()
        _loop(eng, 3)
        first[way] = time.perf_counter() - t
    _set(eng, "sync", B, ctx, pool, temperature)
    b, _ = eng.decode_inputs(list(eng.running.values()))

    def queued():
        for _ in range(steps):
            out = eng.run_decode(b)
        out[1].block_until_ready()

    queued()
    ms = {w: [] for w in (*WAYS, "queued")}
    tokens = {}
    for _ in range(blocks):
        for way in WAYS:
            _set(eng, way, B, ctx, pool, temperature)
            t, tokens[way] = _loop(eng, steps)
            ms[way].append(t)
        t = time.perf_counter()
        queued()
        ms["queued"].append((time.perf_counter() - t) / steps * 1e3)
    assert tokens["fed"] == tokens["sync"] == tokens["async"], f"the loops' tokens differ: {tokens}"
    return {w: statistics.median(v) for w, v in ms.items()}, first


def main(argv: list[str] | None = None) -> None:
    ap = engine_args(__doc__, batches="1,64", weights=False)
    ap.add_argument("--backend", default="auto", help="kernels (timing.kernels_of): auto, xla, ...")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--split-decode", action=argparse.BooleanOptionalAction, default=None,
                    help="the decode step as two programs (default: the platform's, a GPU's: split)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = model_config(args)
    batches = [int(x) for x in args.batches.split(",")]
    t = time.perf_counter()
    eng = make_engine(cfg, P.init_params(cfg, seed=0), True, args.decode_ctx + 256 + args.steps * 8,
                      max(batches), args.backend, scan_layers=args.scan_layers, split_decode=args.split_decode,
                      device_feed=True, own_params=True)
    log.info("engine built in %.1f s (decode programs: %s)", time.perf_counter() - t, "+".join(eng.decode_kinds))
    rows = []
    for B in batches:
        ms, first = measure(eng, B, args.decode_ctx, args.steps, args.blocks, args.temperature)
        log.info("B=%d %s; first 3 steps %s", B, {w: round(v, 3) for w, v in ms.items()},
                 {w: round(v, 1) for w, v in first.items()})
        rows.append([B, *(f"{ms[w]:.3f}" for w in (*WAYS, "queued")), f"{ms['fed'] / ms['sync']:.2f}",
                     f"{ms['fed'] / ms['async']:.2f}", f"{ms['fed'] / ms['queued']:.2f}"])
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, {args.preset} preset ({cfg.n_layers} layers, "
          f"{cfg.n_routed_experts} experts), kernels {args.backend}, decode {'+'.join(eng.decode_kinds)}, context "
          f"{args.decode_ctx}, temperature {args.temperature:g}, {args.blocks} blocks of {args.steps} steps alternated, "
          "medians; the same tokens")
    print_table(["batch", "sync step ms", "async step ms", "fed step ms", "queued program ms (bound)", "fed / sync",
                 "fed / async", "fed / queued"], rows)


if __name__ == "__main__":
    main()
