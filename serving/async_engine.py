"""The synchronous `Engine` on a thread of its own, behind an asyncio-facing API.

The engine is single-threaded: only the engine thread here ever calls it. The asyncio side talks to that thread
through one command queue (add / abort / stats / stop); the engine thread hands each step's outputs back to the
event loop in one `call_soon_threadsafe` per step, where they are routed to per-request `RequestStream`s.

    aeng = AsyncEngine(engine)
    aeng.start()                                   # from inside the running event loop
    async with await aeng.add(rid, prompt_ids, sampling, session) as stream:
        async for out in stream: ...               # StepOutput, the last one has finished=True
    # leaving the block early (client gone, stop string, cancellation) aborts the request: its pages free at once

Failure isolation: a request the engine refuses (EngineError, QueueFull) raises in its own `add` only. A step
that raises is logged with its traceback and fails the request the exception names (a `request_id` attribute)
or, when it names none, every request in flight (each stream raises `EngineStepError`); the loop goes on serving
new requests, and `healthy` is False until a step succeeds or the engine is idle again.

Queue wait: with `max_queue_wait_s`, a request the engine has accepted but not yet scheduled after that long is
aborted and its stream raises `QueueTimeout` (the server answers 503 + Retry-After). The engine thread learns
which requests still wait from `engine.waiting_request_ids()`; the same check times each request's queue wait.

Warm-up: with `warmup=True` the engine thread first runs `engine.warmup()` (every program compiled and loaded),
so the server can listen meanwhile. Until it ends, `ready` is False, `add` raises `WarmingUp` (the server answers
503 + Retry-After) and `warmup_status()` says how far it is; `shutdown()` stops it between two programs. With
`staged_warmup` it ends once the programs that cover every step are ready; the others compile in the background
(`warmup_status()["done"]` turns True when every one is in use).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable

from serving.engine.engine import EngineError, QueueFull, SamplingParams, StepOutput
from serving.metrics import ServingMetrics

log = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "RequestStream", "EngineError", "QueueFull", "EngineStepError", "EngineDead", "StepOutput",
           "QueueTimeout", "SamplingParams", "WarmingUp"]


class EngineStepError(RuntimeError):
    """An engine step raised while this request was in flight; the request was dropped."""


class QueueTimeout(RuntimeError):
    """The request waited in the engine's queue past `max_queue_wait_s` and was dropped: retry later."""


class EngineDead(RuntimeError):
    """The engine thread is not running (never started, stopped, or crashed); no request can be served."""


class WarmingUp(RuntimeError):
    """The engine is still compiling its programs; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    sampling: Any
    session: str | None
    done: concurrent.futures.Future
    arrival: float = 0.0
    images: tuple = ()


@dataclasses.dataclass
class _Abort:
    request_id: str


@dataclasses.dataclass
class _Stats:
    done: concurrent.futures.Future


@dataclasses.dataclass
class _Call:
    """Runs fn(engine) on the engine thread (tests, admin)."""
    fn: Callable[[Any], Any]
    done: concurrent.futures.Future


_STOP = object()


def _settle(fut: concurrent.futures.Future, result: Any = None, exc: BaseException | None = None) -> None:
    """Sets a future that the waiting side may have cancelled meanwhile."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


class RequestStream:
    """The outputs of one request, in order; iterate with `async for`. Aborts the request when closed early."""

    def __init__(self, owner: "AsyncEngine", request_id: str, num_prompt_tokens: int, arrival: float) -> None:
        self.request_id = request_id
        self.arrival = arrival  # time.monotonic() when the request reached the server
        self.num_prompt_tokens = num_prompt_tokens
        self.scheduled_time: float | None = None  # when the engine took it out of its waiting queue
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_generated = 0
        self.finished = False
        self.finish_reason: str | None = None
        self._owner = owner
        self._queue: asyncio.Queue = asyncio.Queue()

    # ---- consumer side ----

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StepOutput:
        if self.finished and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        return item

    def abort(self, reason: str = "abort") -> None:
        """Stops generation now (no-op once finished); pages are freed by the engine thread's next command.
        reason: the finish reason counted in the metrics ("stop" when a stop string ended it)."""
        if not self.finished:
            self.finished = True
            self.finish_reason = reason
            self._owner._abort(self.request_id)
            if self._owner.metrics is not None:
                self._owner.metrics.request_finished(reason)

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()

    # ---- event-loop side (AsyncEngine._deliver) ----

    def _push(self, out: StepOutput, now: float) -> None:
        n = len(out.new_token_ids)
        m = self._owner.metrics
        if n:
            if self.first_token_time is None:
                self.first_token_time = now
                if m is not None:
                    m.ttft.observe(now - self.arrival)
                    if self.scheduled_time is not None:
                        m.prefill_time.observe(now - self.scheduled_time)
                    if n > 1:
                        m.observe_itl(0.0, count=n - 1)
            elif m is not None:
                m.observe_itl((now - self.last_token_time) / n, count=n)
            self.last_token_time = now
            self.num_generated += n
            if m is not None:
                m.generation_tokens.inc(n)
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason
            if m is not None:
                m.request_finished(out.finish_reason)
                m.e2e.observe(now - self.arrival)
                m.output_len.observe(self.num_generated)
                if self.first_token_time is not None:
                    m.decode_time.observe(now - self.first_token_time)
                    if self.num_generated > 1:
                        m.tpot.observe((now - self.first_token_time) / (self.num_generated - 1))
        self._queue.put_nowait(out)

    def _fail(self, exc: BaseException) -> None:
        if not self.finished:
            if self._owner.metrics is not None:
                self._owner.metrics.request_finished("queue_timeout" if isinstance(exc, QueueTimeout) else "error")
            self._queue.put_nowait(exc)


class AsyncEngine:
    """Owns the engine thread. Construct anywhere; `start()` from inside the event loop that will consume it."""

    def __init__(self, engine: Any, *, metrics: ServingMetrics | None = None,
                 stats_interval_s: float = 0.25, max_queue_wait_s: float | None = None, warmup: bool = False,
                 staged_warmup: bool = False) -> None:
        self.engine = engine
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = int(engine.max_model_len)
        self.healthy = True
        self.last_stats: dict[str, Any] = {}
        self._stats_interval = stats_interval_s
        if max_queue_wait_s is not None and not max_queue_wait_s > 0:
            raise ValueError(f"max_queue_wait_s={max_queue_wait_s}: give a positive number of seconds, or None")
        self.max_queue_wait_s = max_queue_wait_s
        self._queued: dict[str, float] = {}  # engine thread: accepted, not yet scheduled -> arrival (monotonic)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # event-loop side: request id -> stream
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._crashed: BaseException | None = None
        self._closed: str | None = None  # why the engine thread takes no more commands; set under _lock
        self._lock = threading.Lock()  # orders _submit against the thread's close, so no command is stranded
        self._stopping = threading.Event()  # shutdown() was called: warm-up ends at the next program
        self._ready = threading.Event()  # warm-up is over (or was not asked for): requests are taken
        # read here, on the constructing thread, so the engine creates it before any other thread asks
        self._progress = engine.warmup_progress if warmup else None
        self._staged = staged_warmup
        if not warmup:
            self._ready.set()

    # ---- lifecycle ----

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() called twice; one AsyncEngine runs one engine thread")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="dsv41-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stops the engine thread after its current step (or warm-up after its current program); requests still
        in flight are aborted."""
        self._stopping.set()
        if self._thread is None:
            return
        for rid in list(self._streams):
            self._commands.put(_Abort(rid))
        self._commands.put(_STOP)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout_s)
        if self._thread.is_alive():
            log.error("engine thread did not stop within %.0f s (a step still running?); leaving it as a daemon",
                      timeout_s)
        for stream in list(self._streams.values()):
            stream._fail(EngineDead("the server is shutting down; retry on another replica"))
        self._streams.clear()
        stop = getattr(self.engine, "stop_followers", None)  # a multi-host engine's other processes stop too
        if stop is not None:
            stop()

    def fail(self, why: str) -> None:
        """Takes no more requests and fails every one in flight with EngineDead(why) (503); any thread may call it.
        For a multi-host engine that lost a process: its engine thread may be blocked in a collective that never
        returns, so nothing here waits for it."""
        self.healthy = False
        self._close(why)
        self._post(lambda: self._fail_requests(list(self._streams), lambda rid: EngineDead(why)))

    @property
    def dead_reason(self) -> str | None:
        """Why the engine takes no more requests (None while it does)."""
        return self._closed

    @property
    def ready(self) -> bool:
        """Warm-up is over: requests are taken."""
        return self._ready.is_set()

    def warmup_status(self) -> dict[str, Any]:
        """{"programs_ready", "programs", "programs_compiled", "eta_s", "done"}; any thread may call it."""
        if self._progress is None:
            return {"programs_ready": 0, "programs": 0, "programs_compiled": 0, "eta_s": None, "done": True}
        return self._progress.snapshot()

    def retry_after_s(self) -> int:
        """Seconds a client refused during warm-up should wait: the ETA, within [1, 30] (the ETA of the first
        programs is rough; a client that asks again sooner gets another 503)."""
        eta = self.warmup_status().get("eta_s")
        return 1 if eta is None else max(1, min(30, int(eta + 0.999)))

    @property
    def alive(self) -> bool:
        """The engine thread runs and takes commands."""
        return self._thread is not None and self._closed is None and self._thread.is_alive()

    # ---- requests ----

    async def add(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                  session: str | None = None, *, arrival: float | None = None, images: tuple = ()) -> RequestStream:
        """Queues a request; returns its stream once the engine has accepted it.

        Raises what `Engine.add_request` raises (EngineError, QueueFull), WarmingUp or EngineDead; never affects
        others.
        """
        if not self._ready.is_set():
            st = self.warmup_status()
            raise WarmingUp(f"the server is warming up ({st['programs_ready']} of {st['programs']} programs ready); "
                            f"retry in {self.retry_after_s()} s", self.retry_after_s())
        if request_id in self._streams:
            raise EngineError(f"request id {request_id!r} is already in flight; use a unique id per request")
        stream = RequestStream(self, request_id, len(prompt_ids), time.monotonic() if arrival is None else arrival)
        self._streams[request_id] = stream  # before the engine sees it, so no output can arrive unrouted
        done: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._submit(_Add(request_id, list(prompt_ids), sampling, session, done, stream.arrival, tuple(images)))
        except EngineDead:
            self._streams.pop(request_id, None)
            raise
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # The caller went away while we waited; the engine may still accept it, so abort behind the add.
            self._streams.pop(request_id, None)
            self._commands.put(_Abort(request_id))
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    async def generate(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                       session: str | None = None) -> AsyncIterator[StepOutput]:
        """Async iterator of the request's StepOutputs. Closing it early (or cancelling its consumer) aborts the
        request. Refusals (EngineError, QueueFull) raise at the first iteration."""
        stream = await self.add(request_id, prompt_ids, sampling, session)
        async with stream:
            async for out in stream:
                yield out

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.abort()
        else:
            self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._commands.put(_Abort(request_id))

    async def stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Fresh `Engine.stats()` from the engine thread (waits for a step in progress); the last snapshot if the
        engine thread is gone or busier than `timeout_s`."""
        if not self.alive or not self._ready.is_set():  # warming up: the engine thread answers nothing
            return dict(self.last_stats)
        done: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._submit(_Stats(done))
        except EngineDead:
            return dict(self.last_stats)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(done), timeout_s)
        except asyncio.TimeoutError:
            log.warning("engine stats took over %.1f s (long step?); serving the last snapshot", timeout_s)
            return dict(self.last_stats)

    def call_in_engine_thread(self, fn: Callable[[Any], Any], timeout_s: float = 30.0) -> Any:
        """Runs fn(engine) on the engine thread and returns its result; for threads other than the event loop's
        (tests, tools). Blocks the calling thread."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Call(fn, done))
        return done.result(timeout_s)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def _submit(self, cmd: Any) -> None:
        """Queues a command that waits for an answer; EngineDead when the thread will never read it."""
        with self._lock:
            if self._thread is None:
                raise EngineDead("AsyncEngine.start() was not called")
            if self._closed is not None:
                raise EngineDead(self._closed)
            self._commands.put(cmd)

    # ---- event-loop side of the engine thread's callbacks ----

    def _deliver(self, outputs: list[StepOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            try:
                stream._push(out, now)
            except Exception:  # a broken consumer must not stop the routing of the others
                log.exception("delivering an output of request %s failed; aborting it", out.request_id)
                stream._fail(EngineStepError(f"internal error while delivering request {out.request_id}"))
                self._abort(out.request_id)
                continue
            if out.finished:
                self._streams.pop(out.request_id, None)

    def _fail_requests(self, request_ids: list[str], exc_factory: Callable[[str], BaseException]) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._fail(exc_factory(rid))

    def _post(self, fn: Callable[..., None], *args: Any) -> bool:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:  # the loop is closed: nobody is listening any more
            return False

    # ---- engine thread ----

    def _run(self) -> None:
        active: set[str] = set()  # engine-thread view: accepted and not yet finished / aborted
        last_stats = 0.0
        failures = 0
        try:
            if not self._ready.is_set():
                self._warm_up()
            while True:
                has_work = self.engine.has_work()
                if not self._drain(active, block=not has_work):
                    break
                if not self.engine.has_work():
                    self.healthy = True  # idle again: whatever failed was cleaned up
                    if self._staged:
                        self.engine.adopt_programs()  # (a busy engine's steps do)
                    if time.monotonic() - last_stats > self._stats_interval:
                        last_stats = self._refresh_stats()
                    continue
                t0 = time.perf_counter()
                started = time.monotonic()
                try:
                    outputs = self.engine.step()
                except Exception as e:
                    failures += 1
                    self._on_step_failure(e, active, failures)
                    self._check_queue(active, started)
                    continue
                failures = 0
                self.healthy = True
                if self.metrics is not None:
                    self.metrics.step_time.observe(time.perf_counter() - t0)
                self._check_queue(active, started)  # before the outputs: a first token finds its scheduled time
                if outputs:
                    for out in outputs:
                        if out.finished:
                            active.discard(out.request_id)
                    if not self._post(self._deliver, outputs):
                        log.info("event loop closed; engine thread exits")
                        break
                if time.monotonic() - last_stats > self._stats_interval:
                    last_stats = self._refresh_stats()
        except BaseException as e:  # a bug in this loop or in has_work/stats: nothing more can be served
            self._crashed = e
            self.healthy = False
            log.exception("engine thread crashed; failing %d request(s) in flight", len(active))
            why = f"the engine thread crashed ({e!r}); see the server log and restart the server"
            self._close(why)
            self._post(self._fail_requests, list(active), lambda rid: EngineDead(why))
        else:
            self._close("the engine thread stopped (server shutting down); retry on another replica")

    def _warm_up(self) -> None:
        """engine.warmup() on this thread (the engine is single-threaded); a raise crashes the thread, so /health
        says the engine is dead. Stopped early by shutdown(): the _STOP it queued ends the loop next."""
        if self._staged:
            self.engine.warmup(should_stop=self._stopping.is_set, staged=True)
        else:
            self.engine.warmup(should_stop=self._stopping.is_set)
        if not self._stopping.is_set():
            self._refresh_stats()
            self._ready.set()

    def _drain(self, active: set[str], *, block: bool) -> bool:
        """Runs queued commands; False on stop. Blocks for the first one when the engine is idle."""
        while True:
            try:
                cmd = self._commands.get(timeout=self._stats_interval) if block else self._commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            if cmd is _STOP:
                for rid in list(active):
                    self._engine_abort(rid)
                return False
            if isinstance(cmd, _Add):
                if cmd.done.cancelled():
                    continue
                try:
                    extra = {"images": cmd.images} if cmd.images else {}  # (engines without vision take none)
                    self.engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.sampling, session=cmd.session,
                                            **extra)
                except Exception as e:  # EngineError / QueueFull / anything: that request's problem only
                    _settle(cmd.done, exc=e)
                else:
                    active.add(cmd.request_id)
                    self._queued[cmd.request_id] = cmd.arrival
                    _settle(cmd.done, True)
            elif isinstance(cmd, _Abort):
                self._queued.pop(cmd.request_id, None)
                if cmd.request_id in active:
                    active.discard(cmd.request_id)
                    self._engine_abort(cmd.request_id)
            elif isinstance(cmd, _Stats):
                try:
                    self.last_stats = self.engine.stats()
                    _settle(cmd.done, dict(self.last_stats))
                except Exception as e:
                    _settle(cmd.done, exc=e)
            elif isinstance(cmd, _Call):
                try:
                    _settle(cmd.done, cmd.fn(self.engine))
                except Exception as e:
                    _settle(cmd.done, exc=e)

    def _waiting_ids(self) -> set[str]:
        return set(self.engine.waiting_request_ids())

    def _check_queue(self, active: set[str], step_start: float) -> None:
        """Times the requests the last step took out of the engine's waiting queue, and drops those that waited
        past max_queue_wait_s (the client gets 503 + Retry-After rather than an answer that may never come)."""
        if not self._queued:
            return
        waiting = self._waiting_ids()
        now = time.monotonic()
        scheduled, expired = [], []
        for rid, arrival in list(self._queued.items()):
            if rid not in active:
                del self._queued[rid]
            elif rid not in waiting:
                del self._queued[rid]
                scheduled.append(rid)
                if self.metrics is not None:
                    self.metrics.queue_time.observe(max(0.0, step_start - arrival))
            elif self.max_queue_wait_s is not None and now - arrival > self.max_queue_wait_s:
                del self._queued[rid]
                expired.append(rid)
                active.discard(rid)
                self._engine_abort(rid)
        if scheduled:
            self._post(self._mark_scheduled, scheduled, step_start)
        if expired:
            limit = self.max_queue_wait_s
            log.warning("%d request(s) waited over --max-queue-wait %.1f s in the queue; dropped", len(expired), limit)
            self._post(self._fail_requests, expired,
                       lambda rid: QueueTimeout(f"request {rid} waited over {limit:g} s in the queue (the server is "
                                                "at capacity); retry later"))

    def _mark_scheduled(self, request_ids: list[str], when: float) -> None:
        for rid in request_ids:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.scheduled_time = when

    def _refresh_stats(self) -> float:
        try:
            self.last_stats = self.engine.stats()
        except Exception:
            log.exception("engine.stats() raised; /metrics keeps the last snapshot")
        return time.monotonic()

    def _engine_abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:
            log.exception("engine.abort(%r) raised; its pages may not have been freed", request_id)

    def _on_step_failure(self, exc: Exception, active: set[str], failures: int) -> None:
        """An exception that names its request (a `request_id` attribute) fails that request only; any other
        fails every request in flight, since the engine state they share may be inconsistent."""
        self.healthy = False
        if self.metrics is not None:
            self.metrics.step_failures.inc()
        culprit = getattr(exc, "request_id", None)
        failed = [culprit] if isinstance(culprit, str) and culprit in active else sorted(active)
        log.exception("engine step raised; failing %d request(s): %s", len(failed), failed[:16])
        for rid in failed:
            self._engine_abort(rid)
            active.discard(rid)
        self._post(self._fail_requests, failed,
                   lambda rid: EngineStepError(f"the engine step failed while request {rid} was in flight "
                                               f"({type(exc).__name__}: {exc}); retry the request"))
        if failures > 1:
            time.sleep(min(0.05 * 2 ** min(failures, 6), 2.0))  # a step that keeps failing: do not spin

    def _close(self, why: str) -> None:
        """Takes no more commands, and answers the queued ones with EngineDead."""
        with self._lock:
            self._closed = why
        exc = EngineDead(why)
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, (_Add, _Stats, _Call)):
                _settle(cmd.done, exc=exc)
