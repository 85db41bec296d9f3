"""Compile workers: processes that compile an engine's warm-up programs into the program store
(`serving.engine.executables`) while the engine's own process draws or loads the weights.

Why: a program's tracing and lowering is Python under the GIL, so an engine's warm-up lowers its programs one after
another, and on a GPU every compile waits behind them: with `dsv41 serve --preset bench`'s defaults (11 programs)
the H100's host spent 16-20 s lowering each decode program, and the server was not healthy after 420 s
(docs/PERFORMANCE.md, section 6). An abstract engine (`Engine.abstract`: jax.ShapeDtypeStruct weights and pool)
lowers and compiles the very programs the allocated engine runs, under the same store keys, so processes can
compile them side by side from the first second of start-up.

`start(cfg, config)` launches `config.compile_workers` processes (`serving/engine/precompile_worker.py`). Worker i
of n builds the abstract engine, takes every n-th program of the warm-up's compile order (the covering programs,
`Engine.covering_shapes`, then the others, each largest first), leaves it where the store holds it already or
lowers, compiles and stores it, and writes one JSON report a program on its stdout. The covering programs compile
alone: the others wait for `GO` on the worker's stdin, which the engine sends once each covering one is reported
(6 compiles at once each took 2.5x as long as one alone), so a staged warm-up (`Warmup.warmup(staged=True)`)
serves early. `Warmup.warmup` waits for them (`CompileWorkers.reports`), counting and logging each program as its
report arrives, then loads every program from the store; one the workers could not give it is compiled there as
before. Only an engine of one process with a program store starts workers (on a mesh each worker builds the
abstract engine on the same devices: `Engine.abstract` places it as the engine is placed), and none start where the
store holds every program of the engine already (a warm-up that ends with all of them stored notes it there:
`ProgramStore.record_engine`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator

import jax

from dsv41.config import ModelConfig
from serving.engine import executables
from serving.engine.config import EngineConfig
from serving.engine.warmup_progress import ProgramReport

log = logging.getLogger(__name__)
GO = b"go\n"  # a worker's stdin after its job: compile the programs past the covering ones


@dataclasses.dataclass(frozen=True)
class Job:
    """What a worker needs to build the abstract engine its parent's engine matches (pickled to its stdin)."""

    cfg: ModelConfig
    config: EngineConfig
    index: int
    count: int
    cache_dir: str
    checkpoint: str | None  # the release directory cfg comes from (its tokenizer), None for a preset
    jax_options: tuple[tuple[str, object], ...]


class CompileWorkers:
    """The running workers of one engine's start-up. `reports()` yields each program's report as a worker sends it
    (`(worker, ProgramReport)`) and returns when every worker has exited."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs = procs
        self.t0 = time.monotonic()
        self.stopped = False
        self._running = len(procs)
        self._released = False
        self._reported: set = set()
        self._queue: queue.Queue = queue.Queue()
        self._readers = [threading.Thread(target=self._read, args=(i, p), daemon=True, name=f"dsv41-precompile-{i}")
                         for i, p in enumerate(procs)]
        for t in self._readers:
            t.start()

    def _read(self, i: int, proc: subprocess.Popen) -> None:
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            try:
                self._queue.put((i, ProgramReport(**json.loads(line))))
            except (ValueError, TypeError):  # not a report: a library's print
                log.debug("compile worker %d: %s", i, line.rstrip())
        self._queue.put((i, None))

    @property
    def done(self) -> bool:
        """Every worker has exited (and its end was read by `reports`)."""
        return not self._running

    def reports(self, should_stop: Callable[[], bool] = lambda: False, first: set | None = None
                ) -> Iterator[tuple[int, ProgramReport]]:
        """Each program's report as a worker sends it, until every worker has exited, or until should_stop()
        (checked every 0.25 s) turns True: then the workers are ended and `stopped` is set. A later call goes on
        where an earlier one stopped. first: the covering programs (`Engine.covering_shapes`), which the workers
        compile before the others (`precompile_worker`): once each is reported, or once a worker has failed, they
        are told to go on with the others (at once when first is None)."""
        if first is None or first <= self._reported:
            self._release()
        while self._running:
            try:
                i, r = self._queue.get(timeout=0.25)
            except queue.Empty:
                if should_stop():
                    self.stop()
                    self.stopped = True
                    return
                continue
            if r is None:
                self._running -= 1
                rc = self.procs[i].wait()
                if rc:
                    self._release()  # the covering programs it held compile in this process
                    log.warning("compile worker %d exited with status %d (its log is above); the programs it did "
                                "not report compile in this process", i, rc)
                continue
            self._reported.add((r.kind, r.B, r.T, r.pages))
            if first is not None and first <= self._reported:
                self._release()
            yield i, r

    def _release(self) -> None:
        """Tells every worker to go on past the covering programs (one line on its stdin, which then closes)."""
        if self._released:
            return
        self._released = True
        for p in self.procs:
            try:
                p.stdin.write(GO)
                p.stdin.close()
            except (BrokenPipeError, OSError, ValueError):  # exited already
                pass

    def stop(self) -> None:
        """Ends the workers (a start-up stopped early): a compile under way cannot be interrupted otherwise."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()


def default_count(platform: str, cpus: int | None = None) -> int:
    """Compile workers `dsv41 serve` starts without --compile-workers (where it warms up with the program store): on
    a GPU half the host's cores, at most 8 (each process lowers one program at a time, and XLA's compile of a
    program uses several threads); on the CPU none (the programs are small, and its cores run the compiles)."""
    if platform == "cpu":
        return 0
    return max(1, min(8, (cpus or os.cpu_count() or 2) // 2))


def start(cfg: ModelConfig, config: EngineConfig, checkpoint: str | None = None) -> CompileWorkers | None:
    """Starts the compile workers `config` asks for (None: none asked, or the engine cannot use them).
    checkpoint: the release directory cfg was read from."""
    n = config.compile_workers
    if not n:
        return None
    store = executables.default_store()
    why = ("the program store is off (--no-program-store)" if not config.program_store
           else "no persistent compilation cache is configured" if store is None else
           "the engine spans several processes" if jax.process_count() > 1 else None)
    if why:
        log.warning("compile workers: none started: %s; warm-up compiles in this process", why)
        return None
    if store.holds_engine(executables.engine_key(cfg, config)):
        log.info("compile workers: none needed: the program store holds every program of this engine (%s)",
                 store.dir)
        return None
    cache_dir = jax.config.jax_compilation_cache_dir
    options = tuple((o, getattr(jax.config, o)) for o in executables._JAX_OPTIONS)
    # The workers hold no weights: no preallocated pool of device memory (the engine's process takes it), and
    # autotuning's buffers go back to the driver after each compile (jax's default allocator keeps what a worker
    # took at its peak; beside the server's 75%, one of 8 workers ran an 80 GB H100 out of memory). The H200's
    # start-up numbers (docs/PERFORMANCE.md section 6) ran with it; against the default allocator it is not timed.
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}
    ckpt = checkpoint and os.path.abspath(checkpoint)
    procs = []
    for i in range(n):
        p = subprocess.Popen([sys.executable, "-m", "serving.engine.precompile_worker"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=env)
        p.stdin.write(pickle.dumps(Job(cfg, config, i, n, cache_dir, ckpt, options)))
        p.stdin.flush()  # left open: `GO` follows once the covering programs are compiled (`CompileWorkers.reports`)
        procs.append(p)
    log.info("compile workers: %d processes compile the warm-up's programs into %s while the weights load", n,
             store.dir)
    return CompileWorkers(procs)
