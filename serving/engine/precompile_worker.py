"""A compile worker's process (`serving.engine.precompile`): its share of an engine's warm-up programs, loaded from
the program store or compiled into it, one JSON `ProgramReport` a program on stdout. Its job (`precompile.Job`)
arrives pickled on stdin."""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
import sys
import time

import jax

from serving import compilation_cache
from serving.engine.engine import Engine
from serving.engine.precompile import GO, Job
from serving.engine.warmup import compile_order
from serving.engine.warmup_progress import ProgramReport

log = logging.getLogger(__name__)
RETRY_WAIT_S = (10.0, 30.0)  # before each further try of a program whose compile ran out of GPU memory


def compile_each(eng: Engine, shapes: list, send, wait_s=RETRY_WAIT_S) -> None:
    """Compiles shapes into the program store, sending each one's report. XLA's autotuning allocates GPU memory
    beside the serving process's pool and the other workers' compiles: a compile that runs out of it is tried again
    after a wait (as the others finish their memory frees), one at a time, rather than leaving this worker's share
    to the serving process. Any other error, or running out every time, ends the worker (the serving process then
    compiles what it did not report)."""
    left = list(shapes)
    for attempt in range(len(wait_s) + 1):
        reported = set()

        def on_ready(r: ProgramReport) -> None:
            reported.add((r.kind, r.B, r.T, r.pages))
            send(r)

        try:
            eng.compile_programs(left, threads=2 if attempt == 0 else 1, on_ready=on_ready, load=False)
            return
        except Exception as e:  # XLA raises its runtime error type; only its status tells what happened
            left = [s for s in left if s not in reported]
            if attempt == len(wait_s) or "RESOURCE_EXHAUSTED" not in str(e):
                raise
            log.warning("out of GPU memory compiling (%s); %d program(s) tried again in %.0f s, one at a time",
                        str(e).splitlines()[0][:200], len(left), wait_s[attempt])
            time.sleep(wait_s[attempt])


def work(job: Job, stdin) -> None:
    """stdin: the rest of the worker's stdin after its job (`GO` comes once the covering programs are compiled)."""
    for o, v in job.jax_options:
        jax.config.update(o, v)
    compilation_cache.configure(job.cache_dir)
    eng = Engine.abstract(job.cfg, dataclasses.replace(job.config, compile_workers=0, program_store=True),
                          checkpoint=job.checkpoint)
    first = eng.covering_shapes()
    # (sorted stably from program_shapes' order: every worker must take the same order)
    order = sorted(first, key=compile_order) + sorted((s for s in eng.program_shapes() if s not in first),
                                                      key=compile_order)
    mine = order[job.index::job.count]

    def send(r: ProgramReport) -> None:
        sys.stdout.write(json.dumps(dataclasses.asdict(r)) + "\n")
        sys.stdout.flush()

    # the engine's process loads them
    compile_each(eng, [s for s in mine if s in first], send)
    rest = [s for s in mine if s not in first]
    if rest and stdin.readline() == GO:  # anything else: the engine's process is gone
        compile_each(eng, rest, send)


def main() -> int:
    job = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s compile worker {job.index} %(levelname)s %(name)s: %(message)s")
    work(job, sys.stdin.buffer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
