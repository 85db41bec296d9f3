"""What a decode step's changing input addresses cost: the decode program (one program, the step not split) called
as the engine calls it (`Engine.run_decode`: the host arrays packed into one buffer and copied to the device at a
new address every call, so XLA updates the CUDA graph of its command buffer before it launches it) against the
same call with the same device buffers every time (nothing to update). The gap between the two is what stable
input addresses (the host rows copied into a buffer the program keeps) would save a step.

    PYTHONPATH=. python3 scripts/bench_launch.py --batches 1,64 --decode-ctx 4096

Prints one table: per batch, the median wall ms of each way (reps alternated in blocks) and their ratios.
"""

from __future__ import annotations

import logging
import statistics
import time

import jax

from timing import engine_args, fake_decode_state, make_engine, model_config, print_table  # noqa: I001 (sys.path)
from dsv41 import params as P

log = logging.getLogger("bench_launch")


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def measure(eng, B: int, ctx: int, reps: int, blocks: int,
            temperature: float = 0.0) -> tuple[float, float, float, float]:
    """-> (median ms with fresh host inputs, median ms with the same device inputs, median ms a call of `reps`
    engine calls queued back to back, compile-and-first-call s)."""
    fake_decode_state(eng, B, ctx, temperature)
    b, _ = eng.decode_inputs(list(eng.running.values()))
    prog = eng.programs.run_full
    t = time.perf_counter()
    eng.run_decode(b)[1].block_until_ready()
    first_s = time.perf_counter() - t
    (params, _, rows, rest), kw = prog._args(eng.params, eng.pool, (b,), eng.static)
    rows, rest = jax.device_put((rows, rest))  # placed once: the same addresses every call

    def fresh():
        eng.run_decode(b)[1].block_until_ready()

    def same():
        eng.pool, _, tok = prog.jitted(params, eng.pool, rows, rest, **kw)
        tok.block_until_ready()

    def queued():  # the engine's calls, none waiting for the one before
        for _ in range(reps):
            out = eng.run_decode(b)
        out[1].block_until_ready()

    eng.pool, logits_same, _ = prog.jitted(params, eng.pool, rows, rest, **kw)
    logits_fresh, _ = eng.run_decode(b)  # the same rows at the same position: the same logits either way
    assert bool((logits_same == logits_fresh).all()), "the two calls differ: they do not run the same step"
    fresh_ms, same_ms, queued_ms = [], [], []
    for _ in range(blocks):
        fresh_ms.append(_median_ms(fresh, reps))
        same_ms.append(_median_ms(same, reps))
        queued_ms.append(_median_ms(queued, 1) / reps)
    return statistics.median(fresh_ms), statistics.median(same_ms), statistics.median(queued_ms), first_s


def main(argv: list[str] | None = None) -> None:
    ap = engine_args(__doc__, batches="1,64", weights=False)  # (--experts 8: the same graph, a shorter build)
    ap.add_argument("--backend", default="auto", help="kernels (timing.kernels_of): auto, xla, ...")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=3)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = model_config(args)
    batches = [int(x) for x in args.batches.split(",")]
    t = time.perf_counter()
    params = P.init_params(cfg, seed=0)
    eng = make_engine(cfg, params, True, args.decode_ctx + 256, max(batches), args.backend, split_decode=False,
                      scan_layers=args.scan_layers)
    log.info("engine built in %.1f s", time.perf_counter() - t)
    rows = []
    for B in batches:
        fresh, same, queued, first = measure(eng, B, args.decode_ctx, args.reps, args.blocks, args.temperature)
        log.info("B=%d fresh %.3f ms same %.3f ms queued %.3f ms (first call %.1f s)", B, fresh, same, queued, first)
        rows.append([B, f"{fresh:.3f}", f"{same:.3f}", f"{same / fresh:.2f}", f"{queued:.3f}", f"{queued / fresh:.2f}",
                     f"{first:.1f}"])
    dev = jax.devices()[0]
    print(f"\n{dev.device_kind}, jax {jax.__version__}, {args.preset} preset ({cfg.n_layers} layers, "
          f"{cfg.n_routed_experts} experts), kernels {args.backend}, context {args.decode_ctx}, "
          f"{args.blocks} blocks of {args.reps} reps alternated, medians")
    print_table(["batch", "fresh host inputs ms (the engine's call)", "same device inputs ms", "same / fresh",
                 "queued ms a call (no wait between calls)", "queued / fresh", "first call (compile) s"], rows)


if __name__ == "__main__":
    main()
