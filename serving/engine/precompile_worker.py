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
from serving.engine.precompile import Job
from serving.engine.warmup import compile_order
from serving.engine.warmup_progress import ProgramReport


def work(job: Job) -> None:
    for o, v in job.jax_options:
        jax.config.update(o, v)
    compilation_cache.configure(job.cache_dir)
    eng = Engine.abstract(job.cfg, dataclasses.replace(job.config, compile_workers=0, program_store=True),
                          checkpoint=job.checkpoint)
    mine = sorted(eng.program_shapes(), key=compile_order)[job.index::job.count]

    def send(r: ProgramReport) -> None:
        sys.stdout.write(json.dumps(dataclasses.asdict(r)) + "\n")
        sys.stdout.flush()

    eng.compile_programs(mine, threads=2, on_ready=send, load=False)  # the engine's process loads them


def main() -> int:
    job = pickle.loads(sys.stdin.buffer.read())
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s compile worker {job.index} %(levelname)s %(name)s: %(message)s")
    work(job)
    return 0


if __name__ == "__main__":
    sys.exit(main())
