"""A compile worker's process (`serving.engine.precompile`): its share of an engine's warm-up programs, loaded from
the program store or compiled into it, one JSON `ProgramReport` a program on stdout. Its job (`precompile.Job`)
arrives pickled on stdin."""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
import sys

import jax

from serving import compilation_cache
from serving.engine.engine import Engine
from serving.engine.precompile import GO, Job
from serving.engine.warmup import compile_order
from serving.engine.warmup_progress import ProgramReport


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
    eng.compile_programs([s for s in mine if s in first], threads=2, on_ready=send, load=False)
    rest = [s for s in mine if s not in first]
    if rest and stdin.readline() == GO:  # anything else: the engine's process is gone
        eng.compile_programs(rest, threads=2, on_ready=send, load=False)


def main() -> int:
    job = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s compile worker {job.index} %(levelname)s %(name)s: %(message)s")
    work(job, sys.stdin.buffer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
