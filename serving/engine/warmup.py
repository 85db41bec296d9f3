"""Start-up compilation: every program an engine's steps can call, compiled and loaded before serving (the
serving analog of capturing CUDA graphs at start-up). `Warmup` is mixed into `Engine`."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import sys
import threading
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from serving.engine import compile_events, executables, programs, spec_sampling
from serving.engine.errors import EngineError
from serving.engine.warmup_progress import ProgramReport, WarmupProgress, report_line

log = logging.getLogger(__name__)
_PROGRESS_LOCK = threading.Lock()  # creates an engine's WarmupProgress once, whichever thread asks first


class Warmup:
    def _padding_call(self, kind: str, B: int, T: int, ctx: int, pool=None):
        """(jitted program, args, static kwargs) for an all-padding batch of that shape: it writes nothing.
        pool: in place of the engine's (a staged warm-up's background lowers on its shapes: the steps donate the
        engine's pool meanwhile)."""
        pool = self.pool if pool is None else pool
        P, S, L = self.layout.num_pages, self.layout.num_slots, self.cfg.n_layers
        rows = [] if kind == "decoder" else self._rows([None] * B, [[]] * B, B, T)
        b = programs.Batch(np.zeros((B, T), np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32),
                           np.full(B, S, np.int32), np.full((B, ctx), P, np.int32), np.zeros(B, np.int32),
                           np.zeros((B, L), np.int32), rows)
        greedy = kind == self.greedy_kind
        kind = kind.removesuffix("_greedy") if greedy else kind
        if self.device_feed and kind in ("decode", "decode_first", "decode_rest", "spec_rest"):
            b = self._feed_padding(b)
        static, progs = self.static, self.programs
        if kind == "encoder":
            return progs.run_encoder, (self.params, pool, b), {**static, "replay_tokens": self.replay_tokens}
        if kind in ("decoder", "decode_rest", "spec_rest"):
            W, hc = (self.replay_tokens if kind == "decoder" else T), self.cfg.hc_mult
            # committed like the step's, which come out of the program before: a program compiles once per
            # committed / uncommitted signature of its arguments
            # (tests/test_engine.py::test_warmup_leaves_nothing_to_compile)
            on = pool.runs[0].swa_q.sharding
            h = jnp.zeros((B, W, hc, self.cfg.dim), self.num.jdtype, device=on)
            pre = jnp.zeros((B, W, hc), jnp.float32, device=on)
            if kind == "decode_rest":
                return progs.run_decode_rest, (self.params, pool, programs.rest_batch(b, self.cfg), h, pre), static
            if kind == "spec_rest":
                return progs.run_spec_rest, (self.params, pool, programs.rest_batch(b, self.cfg), h, pre,
                                             *self._spec_padding(B)), self.spec_static(greedy)
            return progs.run_decoder, (self.params, pool, b, h, pre), self.prefill_static
        if kind == "decode_first":
            return progs.run_decode_first, (self.params, pool, b), static
        if kind == "decode" and self.spec is not None:
            return progs.run_spec, (self.params, pool, b, *self._spec_padding(B)), self.spec_static(greedy)
        return progs.run_full, (self.params, pool, b), static if kind == "decode" else self.prefill_static

    def _spec_padding(self, B: int) -> tuple:
        """A speculative step's arguments after its batch (and stream) for B padding rows: sampling, has_q,
        forced, n_verify, as `speculative.py`'s step passes them."""
        forced, samp = np.full(B, self.spec.forced_acceptance), self._sampling([None] * B)
        return samp, np.zeros(B, bool), forced, np.zeros(B, np.int32)

    def spec_static(self, greedy: bool) -> dict:
        """A speculative program's static keywords, as every call passes them (greedy: the all-greedy variant).
        Its sampling branch (`spec_sampling.verify`): with the all-greedy program (`greedy_kind`) the host picks
        it, GREEDY or else FILTERED (which serves every row: one program, no branch on the device, so no host
        round trip on a GPU); without, a `lax.switch` on the device (None)."""
        branch = None if self.greedy_kind is None else spec_sampling.GREEDY if greedy else spec_sampling.FILTERED
        return {**self.static, "spec_tokens": self.spec.num_speculative_tokens, "branch": branch}

    @property
    def warmup_progress(self) -> WarmupProgress:
        """How far `warmup()` is; safe to read from any thread (the server's /health reads it while the engine
        thread warms up)."""
        p = self.__dict__.get("_warmup_progress")
        if p is None:
            with _PROGRESS_LOCK:
                p = self.__dict__.setdefault("_warmup_progress", WarmupProgress())
        return p

    def warmup(self, workers: int = 8, should_stop: Callable[[], bool] | None = None, staged: bool = False
               ) -> list[tuple[str, int, int, int]]:
        """Compiles and loads every program of `program_shapes()` so that no request waits for a compile (the
        serving analog of capturing CUDA graphs at start-up). With a persistent compilation cache configured,
        each program is first loaded from the program store beside it (`executables`: nothing traced) or
        compiled, in `workers` threads at once (XLA compiles off the GIL), and kept as this engine's executable;
        then each runs once on an all-padding batch. Without one, each program compiles as it first runs. Logs
        one line per program (shape, lower and compile time, where it came from, ETA) and keeps
        `warmup_progress` current.
        staged (with a persistent cache, in one process): returns once `covering_shapes()` (the largest prefill
        chunk, the replay decoder, the largest decode batch) are ready; the other programs compile in a background
        thread (and the compile workers) meanwhile, and steps pad to the covering programs until each arrives:
        `step()` runs each arrival once between two steps and then uses it (`wait_for_programs` waits for all).
        `warmup_progress.done` turns True when every program is in use.
        should_stop: checked between programs; True ends warm-up early (a server told to stop while warming).
        -> the shapes ready on return."""
        shapes = self.program_shapes()
        n = len(shapes)
        progress = self.warmup_progress
        progress.start(n)
        stop = should_stop or (lambda: False)
        t0 = time.perf_counter()
        cached = bool(jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir)
        parallel = cached
        first = self.covering_shapes() if staged and parallel and jax.process_count() == 1 else shapes
        rest = [s for s in shapes if s not in first]
        log.info("warm-up: %d programs to compile and load (%s, %s)%s", n,
                 f"{len(self._compiling.procs)} compile workers, then {workers} compile threads"
                 if parallel and self._compiling is not None else
                 f"{workers} compile threads" if parallel else "one at a time",
                 f"persistent cache {jax.config.jax_compilation_cache_dir}" if cached else "no persistent cache",
                 f"; serving once the {len(first)} that cover every step are ready" if rest else "")
        stored: set = set()
        counted: set = set()
        if parallel:
            stored = self._compile_or_load(first, workers, stop, progress, counted, staged=bool(rest))
            if stored is None:
                return []
            log.info("warm-up: %d programs compiled or loaded (%d from the program store) in %.1f s; running each "
                     "once", len(first), len(stored), time.perf_counter() - t0)
        elif self._compiling is not None:
            self._compiling.stop()  # nothing to load their programs from
            self._compiling = None
        like = None  # (width, dtype, placement) of a program's logits: the background's sampling warm-up makes such
        with _progress_bar(len(first), "warm-up: loading" if parallel else "warm-up") as bar:
            for shape in first:
                if stop():
                    log.info("warm-up stopped after %d of %d programs", progress.snapshot()["programs_ready"], n)
                    return []
                logits = self._run_once(shape, shape in stored, parallel)
                if logits is not None:
                    like = logits.shape[1:], logits.dtype, logits.sharding
                bar.update(1)
        jax.block_until_ready(self.pool)
        if rest:
            self.usable_shapes = frozenset(first)
            pool = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                          self.pool)
            self._background = _Background(self, rest, workers, stop, counted, t0, pool, like)
            log.info("warm-up: serving after %.1f s on %s; %d more programs compile in the background (until each "
                     "is ready, steps pad to these)", time.perf_counter() - t0,
                     ", ".join(_shape_name(s) for s in first), len(rest))
            return first
        progress.finish()
        log.info("warm-up: %d programs ready in %.1f s", n, time.perf_counter() - t0)
        return shapes

    def _run_once(self, shape: tuple[str, int, int, int], from_store: bool, parallel: bool) -> jax.Array | None:
        """Runs a compiled or loaded program once on an all-padding batch (and compiles its sampling variants), on
        the engine's thread: the pool is donated to it. -> its logits [B, V] where a step may sample them, else None."""
        progress = self.warmup_progress
        fn, args, static = self._padding_call(*shape)
        with compile_events.capture() as c:
            out = fn(*args, **static)
        if from_store:
            _first_run(shape, out)
        self.pool = out[0]
        if self.device_feed and self.spec is not None and shape[0] in ("decode", "spec_rest", self.greedy_kind):
            self._spec_padded((*out[2:5], self._next_verify(out[5])))  # as the next step's `SpecFeed`'s
        elif self.device_feed and shape[0] in ("decode", "decode_rest"):
            self._pad(out[2])  # its ids padded as the next step's `Feed.prev`
        elif self.device_feed and shape[0] in ("full", "decoder"):
            self._pad_first(out[2])  # a prompt's first tokens: `Feed.first`
        logits = out[1] if self._samples(shape) else None
        if logits is not None:
            self._warm_sample(logits)
        if not parallel:
            r = _report(shape, c)
            eta = progress.compiled(r)
            log.info("warm-up %s", report_line(progress.snapshot()["programs_compiled"], progress.total, r, eta))
        elif c.source == compile_events.COMPILED:
            log.warning("warm-up: %s compiled again when loaded (%.1f s): the persistent cache did not keep it; "
                        "check that %s is writable", shape, c.compile_s, jax.config.jax_compilation_cache_dir)
        progress.loaded()
        return logits

    def _samples(self, shape: tuple[str, int, int, int]) -> bool:
        """Whether a step of this program may run `Programs.sample` on its logits (a speculative step samples
        inside its program)."""
        return (shape[0] not in ("encoder", "decode_first", "spec_rest", self.greedy_kind)
                and not (shape[0] == "decode" and self.spec is not None))

    def adopt_programs(self) -> None:
        """A staged warm-up's programs that the background finished: runs each once, then lets steps use it; when
        every program is in use, warm-up is done. The engine's thread calls it between two steps (`step` does, and
        an idle server's loop)."""
        bg = self._background
        if bg is None:
            return
        for shape in bg.arrived():
            self._run_once(shape, True, True)
            self.usable_shapes = self.usable_shapes | {shape}
            log.info("warm-up: %s ready (%d of %d programs)", _shape_name(shape), len(self.usable_shapes),
                     self.warmup_progress.total)
        if bg.failed or len(self.usable_shapes) == self.warmup_progress.total:
            self._background = None
            if not bg.failed:
                self.usable_shapes = None
                self.warmup_progress.finish()
                log.info("warm-up: all %d programs ready in %.1f s", self.warmup_progress.total,
                         time.perf_counter() - bg.t0)

    def wait_for_programs(self, timeout_s: float | None = None) -> bool:
        """Waits for a staged warm-up's background compiles, then puts every program in use (the engine's thread
        only). -> whether every program is in use."""
        bg = self._background
        if bg is not None:
            bg.thread.join(timeout_s)
            self.adopt_programs()
        return self.usable_shapes is None

    def _warm_sample(self, logits) -> None:
        """Compiles (or finds) `Programs.sample`'s variants for a program's logits [B, V]: small programs, so that a
        step with rows that draw compiles nothing either."""
        samp = self._sampling([None] * logits.shape[0])
        for filtered in (False, True):
            self.programs.sample(logits, samp, filtered=filtered)

    def _record(self, counted: set, r: ProgramReport, where: str = "") -> None:
        """Counts and logs a program's compile (or load) report once, whichever of the workers and this process
        sends it first."""
        shape = (r.kind, r.B, r.T, r.pages)
        if shape in counted:
            return
        counted.add(shape)
        progress = self.warmup_progress
        eta = progress.compiled(r)
        log.info("warm-up %s%s", report_line(progress.snapshot()["programs_compiled"], progress.total, r, eta), where)

    def _compile_or_load(self, shapes, workers: int, stop: Callable[[], bool], progress: WarmupProgress,
                         counted: set, staged: bool) -> set | None:
        """Warm-up's compile phase with a persistent cache: the compile workers' reports as they arrive (each
        program counted and logged once, `precompile`) until they are done, or, staged, until every one of `shapes`
        has come (the workers compile the covering programs first: `precompile_worker`; the background takes the
        rest), then `compile_programs` over `shapes` (those the workers compiled load from the store). -> the
        shapes loaded from the store; None when stopped early."""
        n = progress.total

        def stopped() -> bool:
            if stop():
                log.info("warm-up stopped after compiling %d of %d programs (the compiles under way finish in the "
                         "background: XLA cannot interrupt them)", progress.snapshot()["programs_compiled"], n)
                return True
            return False

        with _progress_bar(len(shapes), "warm-up: compiling") as bar:
            def record(r: ProgramReport, where: str = "") -> None:
                if (r.kind, r.B, r.T, r.pages) not in counted:
                    bar.update(1)
                self._record(counted, r, where)

            workers_ = self._compiling
            if workers_ is not None:
                for i, r in workers_.reports(stopped, first=set(self.covering_shapes())):
                    record(r, f" (compile worker {i})")
                    if staged and counted.issuperset(shapes):
                        break  # the background takes the others' reports
                if workers_.stopped:
                    return None
                if workers_.done:
                    self._compiling = None
                    log.info("warm-up: the compile workers are done after %.1f s", time.monotonic() - workers_.t0)
            return self.compile_programs(shapes, workers, record, stopped)

    def compile_programs(self, shapes, threads: int, on_ready: Callable[[ProgramReport], None],
                         stop: Callable[[], bool] = lambda: False, load: bool = True, pool=None) -> set | None:
        """Gives every shape's program its executable, loaded from the program store or compiled (into the
        persistent cache and the store), calling on_ready with each program's report -> the shapes found in the
        store; None when stop() turned True. load=False (a compile worker): a stored program is left there; with
        load, an engine whose every program ends up stored is noted in the store (`ProgramStore.record_engine`).
        The store's programs load in `threads` threads at once; then this thread traces and lowers the others one
        after another, the largest first (`compile_order`), and hands each lowered one to one of `threads` threads
        for XLA's compile, which runs off the GIL meanwhile. Lowering is Python under the GIL: lowered in several
        threads at once, every program finished lowering late and every compile started late (the tiny preset on 2
        cores: 16.0 s to compile 3 programs, against 12.8 s one after another); processes lower side by side
        (`precompile`). pool: the KV pool's shapes to lower on (`_padding_call`), the engine's by default."""
        def compile_one(shape, call, lowered, lowering: compile_events.Compiles) -> ProgramReport:
            with compile_events.capture() as c:
                compiled = lowered.compile()
            c.add(lowering)
            fn, args, static = call
            fn.keep(compiled, *args, key=keys[shape] if c.source == compile_events.COMPILED else None, **static)
            return _report(shape, c)

        def report(done) -> None:
            for fut in done:
                futures.pop(fut)
                on_ready(fut.result())

        store = self.executables.store if self.executables is not None else None
        keys: dict[tuple, str | None] = {}  # each shape's program store key

        def from_store(shape) -> tuple[tuple, ProgramReport | None]:
            """-> (the shape's padding call, its report if the store holds it)."""
            fn, args, static = call = self._padding_call(*shape, pool=pool)
            t0 = time.perf_counter()
            keys[shape], held = fn.find(*args, load=load, **static)
            if held:
                return call, ProgramReport(*shape, 0.0, time.perf_counter() - t0, compile_events.STORED)
            return call, None

        futures: dict[concurrent.futures.Future, tuple] = {}
        stored = set()
        ex = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="dsv41-compile")
        try:
            # what the store holds first, in the threads at once
            calls = {}
            for shape, (call, r) in zip(shapes, ex.map(from_store, shapes)):
                calls[shape] = call
                if r is not None:
                    stored.add(shape)
                    on_ready(r)
            for shape in sorted(shapes, key=compile_order):
                if stop():
                    return None
                if shape in stored:
                    continue
                fn, args, static = calls[shape]
                with compile_events.capture() as lowering:
                    lowered = fn.lower(*args, **static)
                futures[ex.submit(compile_one, shape, (fn, args, static), lowered, lowering)] = shape
                report([f for f in futures if f.done()])
            while futures:
                # a timeout, so that a stop is seen while long compiles run
                done, _ = concurrent.futures.wait(futures, timeout=0.25, return_when=concurrent.futures.FIRST_COMPLETED)
                if stop():
                    return None
                report(done)
        finally:
            # not waiting: a stop (or an error) returns at once, and the queued compiles are dropped
            ex.shutdown(wait=False, cancel_futures=True)
        if load and store is not None:
            self._note_if_all_stored(store, keys)
        return stored

    def _note_if_all_stored(self, store: executables.ProgramStore, keys: dict) -> None:
        """Notes in the store that it holds every program of this engine once it does (over every
        `compile_programs` call of a warm-up): the next start with the same model and options needs no compile
        workers (`precompile.start`)."""
        known = self.__dict__.setdefault("_store_keys", {})
        known.update(keys)
        shapes = self.program_shapes()
        if all(known.get(s) is not None and store.has(known[s]) for s in shapes):
            store.record_engine(executables.engine_key(self.cfg, self.config), [known[s] for s in shapes])


class _Background:
    """A staged warm-up's other programs, compiled or loaded in a thread of their own: each one the compile workers
    report is loaded from the store as it comes, then any they did not give is compiled here. Each is handed to the
    engine's thread (`arrived`) once its executable is kept; `failed`: a compile raised (logged), and steps keep
    padding to the programs in use."""

    def __init__(self, engine: Any, rest: list, threads: int, stop: Callable[[], bool], counted: set, t0: float,
                 pool: Any, logits_like: tuple | None):
        """pool: the KV pool as jax.ShapeDtypeStructs (the engine's steps donate its arrays while this lowers).
        logits_like: (shape past the rows, dtype, sharding) of a program's logits, for each arrival's sampling
        variants to compile here rather than on the engine's thread (which then finds them in jit's cache)."""
        self.t0 = t0
        self.failed = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, args=(engine, list(rest), threads, stop, counted, pool,
                                                               logits_like), name="dsv41-warmup", daemon=True)
        self.thread.start()

    def arrived(self) -> list[tuple[str, int, int, int]]:
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def _run(self, eng: Any, pending: list, threads: int, stop: Callable[[], bool], counted: set, pool: Any,
             logits_like: tuple | None) -> None:
        def ready(r: ProgramReport) -> None:
            eng._record(counted, r)
            shape = (r.kind, r.B, r.T, r.pages)
            if shape in pending:
                if logits_like is not None and eng._samples(shape):
                    width, dtype, placed = logits_like
                    eng._warm_sample(jax.device_put(np.zeros((r.B, *width), dtype), placed))
                pending.remove(shape)
                self._queue.put(shape)

        try:
            workers_, eng._compiling = eng._compiling, None
            if workers_ is not None:
                for i, r in workers_.reports(stop):
                    eng._record(counted, r, f" (compile worker {i})")
                    if (r.kind, r.B, r.T, r.pages) in pending and eng.compile_programs(
                            [(r.kind, r.B, r.T, r.pages)], 1, ready, stop, pool=pool) is None:
                        return
                if workers_.stopped:
                    return
                log.info("warm-up: the compile workers are done after %.1f s", time.monotonic() - workers_.t0)
            if pending:
                eng.compile_programs(list(pending), threads, ready, stop, pool=pool)
        except Exception:
            log.exception("warm-up: a background compile failed; steps keep padding to the programs in use")
            self.failed = True


def _shape_name(shape: tuple[str, int, int, int]) -> str:
    kind, B, T, _ = shape
    return f"{kind} B={B} T={T}"


# whole-model programs first, then the prefill encoder, then the replay decoder; larger batches first within a kind:
# the longest compiles start first, so the last to finish starts early
_KIND_ORDER = {"decode": 0, "decode_first": 0, "decode_rest": 0, "spec_rest": 0, "decode_greedy": 0,
               "spec_rest_greedy": 0, "full": 1, "encoder": 1, "decoder": 2}


def compile_order(shape: tuple[str, int, int, int]) -> tuple[int, int]:
    kind, B, T, _ = shape
    return _KIND_ORDER[kind], -B * T


def _first_run(shape: tuple[str, int, int, int], out) -> None:
    """Waits for the first run of a program loaded from the program store: an entry that loads but does not run
    stops the start with the fix named, rather than the first request."""
    try:
        jax.block_until_ready(out)
    except Exception as e:
        raise EngineError(f"warm-up: the {shape[0]} program {shape[1:]} loaded from the program store in "
                          f"{jax.config.jax_compilation_cache_dir} failed when run ({type(e).__name__}: {e}); delete "
                          f"its {executables.STORE_SUBDIR} directory (or give another --compilation-cache-dir) and "
                          "start again") from e


def _report(shape: tuple[str, int, int, int], c: compile_events.Compiles) -> ProgramReport:
    kind, B, T, pages = shape
    return ProgramReport(kind, B, T, pages, c.lower_s, c.compile_s, c.source)


class _NoBar:
    def update(self, n: int) -> None:
        pass


@contextlib.contextmanager
def _progress_bar(total: int, desc: str) -> Iterator[Any]:
    """A tqdm bar on a terminal (log lines printed above it); nothing otherwise (the log lines say it all)."""
    if not sys.stderr.isatty():
        yield _NoBar()
        return
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(), tqdm(total=total, desc=desc, unit="program", file=sys.stderr) as bar:
        yield bar
