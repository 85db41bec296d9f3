"""OpenAI-compatible HTTP server on FastAPI + uvicorn over an `AsyncEngine`.

Routes: GET /health, GET /metrics (Prometheus), GET /v1/models[/{id}], POST /v1/completions,
POST /v1/chat/completions (streaming as SSE `data: {...}` chunks ending in `data: [DONE]`, or not), and the
schema at /openapi.json (+ /docs). Request fields and their limits: `serving.protocol`; what the server does
with them: `serving.requests`; the text side of responses: `serving.response`.

Errors use OpenAI's body `{"error": {"message", "type", "param", "code"}}`: 400 for bad input (malformed JSON or
encoding, wrong types, out-of-range values, a prompt over max_model_len), 404 for an unknown model or route, 413
for a body over MAX_BODY_BYTES, 503 with Retry-After when the queue is full, a request waited past
--max-queue-wait or the engine is still warming up, 500 when an engine step fails the request. A bad request never
affects the others.

Warm-up: the server listens while the engine compiles its programs; meanwhile /health answers 503 with
`{"status": "warming up", "programs_ready", "programs", ...}` and generation requests 503 + Retry-After.

A streamed response sends its headers with the first token, so a request that never leaves the queue still gets
its 503. A client that disconnects (before or during the answer) aborts its request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
import uuid
import zlib
from typing import Any, AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.async_engine import (AsyncEngine, EngineDead, EngineError, EngineStepError, QueueFull, QueueTimeout,
                                  RequestStream, WarmingUp)
from serving.errors import ApiError, bad_request
from serving.media import MediaConfig
from serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from serving.metrics import ServingMetrics
from serving.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                              ErrorResponse, Health, HealthWarmingUp, ModelCard, ModelList)
from serving.requests import GenRequest, ServerConfig, chat_request, completion_request, validation_error
from serving.response import ChatChunker, TextPipeline, chat_completion_body, finish_reason_of, sse, usage_of

log = logging.getLogger(__name__)
access_log = logging.getLogger("dsv41.access")

MAX_BODY_BYTES = 64 * 1024 * 1024
RETRY_AFTER_S = 1
_TOKENIZE_OFF_LOOP_BYTES = 64 * 1024
_ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/openapi.json", "/docs")
_ERRORS = {400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}, 413: {"model": ErrorResponse},
           500: {"model": ErrorResponse}, 503: {"model": ErrorResponse}}


def _json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False).encode(), status, headers, "application/json")


def _error_response(e: ApiError) -> Response:
    return Response(e.body_bytes(), e.status, e.headers, "application/json")


# ---- the request body: size, encoding, JSON ------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def _read_body(request: Request) -> bytes:
    """The body, decompressed, within MAX_BODY_BYTES; ApiError for anything a client can fix."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return raw
    wbits = {"gzip": 31, "x-gzip": 31, "deflate": 15}.get(encoding)
    if wbits is None:
        raise ApiError(415, f"Content-Encoding {encoding!r} is not supported; send identity, gzip or deflate",
                       code="unsupported_encoding")
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(raw, MAX_BODY_BYTES + 1)
    except zlib.error as e:
        raise bad_request(f"the body is not {encoding} data ({e}); compress it, or drop the Content-Encoding "
                          "header", code="invalid_encoding") from None
    if len(out) > MAX_BODY_BYTES or d.unconsumed_tail:
        raise ApiError(413, f"the decompressed request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
    if not d.eof:
        raise bad_request(f"the {encoding} body is truncated; send the whole stream", code="invalid_encoding")
    return out


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, NaN/Infinity, absurd nesting
        raise bad_request(f"the request body is not valid JSON ({e}); send a JSON object", code="invalid_json") \
            from None


class _BodyRoute(APIRoute):
    """Reads, decompresses and parses a POST body before FastAPI validates it, so that every failure of those
    is an OpenAI error a client can act on (FastAPI answers a bad gzip body with a bare 400)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            if request.method == "POST":
                raw = await _read_body(request)
                request._body = raw  # Starlette's caches: FastAPI's body reading finds them filled
                if raw:
                    request._json = _parse_json(raw)
            return await handler(request)

        return handle


# ---- disconnects --------------------------------------------------------------------------------------------


class _ClientGone(Exception):
    pass


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Runs `work` until it finishes or the client disconnects (then cancels it, which aborts its request)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise _ClientGone


class _SSEResponse(StreamingResponse):
    """Watches for the client's disconnect whatever the ASGI version (Starlette stops watching at 2.4, where it
    relies on a failed send, which never comes while a request waits for its next token) and aborts the request's
    stream however the response ends."""

    def __init__(self, content: AsyncIterator[bytes], stream: RequestStream, headers: dict[str, str]) -> None:
        super().__init__(content, headers=headers, media_type="text/event-stream")
        self._stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        run = asyncio.ensure_future(self.stream_response(send))
        watch = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait((run, watch), return_when=asyncio.FIRST_COMPLETED)
            if not run.done():
                log.info("client of %s disconnected mid-stream; request aborted", self._stream.request_id)
                run.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await run
        finally:
            watch.cancel()
            run.cancel()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()
            self._stream.abort()


# ---- access log and HTTP metrics -------------------------------------------------------------------------------


class _AccessLog:
    """ASGI middleware: one log line and one http_requests sample per request. Handlers leave the request's token
    counts and TTFT in `request.state.gen` (a dict)."""

    def __init__(self, app: Any, metrics: ServingMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.monotonic()
        state = scope.setdefault("state", {})
        status = [499]  # unless a response starts: the client left first

        async def send_status(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except BaseException:
            status[0] = 500 if status[0] == 499 else status[0]
            raise
        finally:
            route = scope.get("route")
            self.metrics.http_request(getattr(route, "path", "unmatched"), scope["method"], status[0])
            if access_log.isEnabledFor(logging.INFO):
                gen = state.get("gen") or {}
                ttft = gen.get("ttft")
                access_log.info('%s:%s "%s %s" %d prompt_tokens=%s output_tokens=%s ttft=%s total=%.3fs%s',
                                *(scope.get("client") or ("-", 0)), scope["method"], scope["path"], status[0],
                                gen.get("prompt_tokens", "-"), gen.get("output_tokens", "-"),
                                "-" if ttft is None else f"{ttft:.3f}s", time.monotonic() - t0,
                                f" id={gen['id']}" if "id" in gen else "")


# ---- the server ------------------------------------------------------------------------------------------------


class OpenAIServer:
    """The FastAPI application's state and handlers. `app` is the ASGI application (the access log around it)."""

    def __init__(self, async_engine: AsyncEngine, *, model_name: str, metrics: ServingMetrics | None = None,
                 media: MediaConfig | None = None) -> None:
        self.engine = async_engine
        self.metrics = metrics or async_engine.metrics or ServingMetrics(model_name)
        if async_engine.metrics is None:
            async_engine.metrics = self.metrics
        tok = async_engine.tokenizer
        self.tokenizer = tok
        self.cfg = ServerConfig(model_name=model_name, max_model_len=async_engine.max_model_len,
                                vocab_size=tok.vocab_size, eos_id=tok.eos_id, bos_id=tok.bos_id,
                                model_cfg=getattr(async_engine.engine, "cfg", None), media=media or MediaConfig())
        self.created = int(time.time())
        api = FastAPI(title="dsv41", version="0.1.0", lifespan=self._lifespan,
                      description="OpenAI-compatible API of dsv41 (DeepSeek-V4.1-Flash).")
        api.router.route_class = _BodyRoute
        api.add_exception_handler(ApiError, self._on_api_error)
        api.add_exception_handler(RequestValidationError, self._on_validation_error)
        api.add_exception_handler(StarletteHTTPException, self._on_http_error)
        api.add_exception_handler(Exception, self._on_exception)
        api.add_api_route("/health", self.health, methods=["GET"], response_model=Health,
                          responses={503: {"model": ErrorResponse | HealthWarmingUp}})
        api.add_api_route("/metrics", self.metrics_text, methods=["GET"], response_class=Response,
                          responses={200: {"content": {"text/plain": {}}}})
        api.add_api_route("/v1/models", self.models, methods=["GET"], response_model=ModelList)
        api.add_api_route("/v1/models/{model_id}", self.model, methods=["GET"], response_model=ModelCard,
                          responses={404: {"model": ErrorResponse}})
        api.add_api_route("/v1/completions", self.completions, methods=["POST"], response_model=CompletionResponse,
                          responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}}})
        api.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"],
                          response_model=ChatCompletionResponse,
                          responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}}})
        self.fastapi = api
        self.app = _AccessLog(api, self.metrics)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        if self.engine._thread is None:
            self.engine.start()
        log.info("serving %r (max_model_len %d)", self.cfg.model_name, self.cfg.max_model_len)
        try:
            yield
        finally:
            await self.engine.shutdown()

    # ---- errors ----

    async def _on_api_error(self, request: Request, e: ApiError) -> Response:
        if e.status >= 500:
            log.warning("%s %s -> %d: %s", request.method, request.url.path, e.status, e.message)
        return _error_response(e)

    async def _on_validation_error(self, request: Request, e: RequestValidationError) -> Response:
        self.metrics.request_rejected("invalid")
        return _error_response(validation_error(e.errors()))

    async def _on_http_error(self, request: Request, e: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status_code)
        path = request.url.path
        msg = {404: f"no route {path!r}; see {', '.join(_ROUTES)}",
               405: f"{request.method} is not allowed on {path}"}.get(e.status_code, str(e.detail))
        headers = {k: v for k, v in (e.headers or {}).items() if k.lower() == "allow"}
        return _error_response(ApiError(e.status_code, msg, code=code, headers=headers))

    async def _on_exception(self, request: Request, e: Exception) -> Response:
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return _error_response(ApiError(500, "internal server error; see the server log", code="internal_error"))

    # ---- simple routes ----

    async def health(self) -> Response:
        """{"status": "ok"}, with "processes" (each one's state) for a multi-host engine and "programs_ready" /
        "programs" while a staged warm-up compiles the rest in the background; 503 otherwise."""
        if not self.engine.alive:
            return _error_response(ApiError(503, self.engine.dead_reason or "the engine thread is not running; "
                                            "restart the server", code="engine_dead"))
        if not self.engine.ready:
            st = self.engine.warmup_status()
            body = {"status": "warming up", **{k: st[k] for k in HealthWarmingUp.model_fields if k in st}}
            return _json_response(body, 503, {"Retry-After": str(self.engine.retry_after_s())})
        if not self.engine.healthy:
            return _error_response(ApiError(503, "the last engine step failed; see the server log",
                                            code="engine_unhealthy", headers={"Retry-After": str(RETRY_AFTER_S)}))
        body: dict[str, Any] = {"status": "ok"}
        processes = getattr(self.engine.engine, "processes", None)
        if processes is not None:
            body["processes"] = processes()
        st = self.engine.warmup_status()
        if not st["done"]:
            body.update(programs_ready=st["programs_ready"], programs=st["programs"])
        return _json_response(body)

    async def metrics_text(self) -> Response:
        stats = await self.engine.stats(timeout_s=2.0)
        return Response(self.metrics.render(stats), headers={"Content-Type": METRICS_CONTENT_TYPE})

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.cfg.model_name, "object": "model", "created": self.created, "owned_by": "dsv41",
                "root": self.cfg.model_name, "parent": None, "max_model_len": self.cfg.max_model_len}

    async def models(self) -> Response:
        return _json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, model_id: str) -> Response:
        if model_id != self.cfg.model_name:
            raise ApiError(404, f"the model {model_id!r} does not exist; this server serves "
                                f"{self.cfg.model_name!r}", param="model", code="model_not_found")
        return _json_response(self._model_card())

    # ---- generation ----

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await self._generate(request, body, completion_request, "completions", "cmpl")

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await self._generate(request, body, chat_request, "chat_completions", "chatcmpl")

    async def _generate(self, request: Request, body: Any, convert: Callable, endpoint: str, prefix: str
                        ) -> Response:
        try:
            return await _unless_disconnected(request, self._serve(request, body, convert, endpoint, prefix))
        except _ClientGone:
            return Response(status_code=499)

    async def _serve(self, request: Request, body: Any, convert: Callable, endpoint: str, prefix: str) -> Response:
        arrival = time.monotonic()
        session = request.headers.get("x-session-id") or None
        try:
            # long prompts and images (decoding, resizing, fetching): keep the event loop responsive
            if len(request._body) > _TOKENIZE_OFF_LOOP_BYTES or b"image_url" in request._body:
                req = await asyncio.to_thread(convert, body, self.cfg, self.tokenizer, session)
            else:
                req = convert(body, self.cfg, self.tokenizer, session)
        except ApiError as e:
            self.metrics.request_rejected("not_found" if e.status == 404 else "invalid")
            raise
        rid = f"{prefix}-{uuid.uuid4().hex}"
        gen = request.state.gen = {"id": rid, "prompt_tokens": len(req.prompt_ids)}
        try:
            stream = await self.engine.add(rid, req.prompt_ids, req.sampling, req.session, arrival=arrival,
                                           images=req.images)
        except QueueFull as e:
            self.metrics.request_rejected("queue_full")
            raise ApiError(503, f"the server is at capacity ({e}); retry after {RETRY_AFTER_S} s",
                           code="queue_full", type="server_overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineError as e:
            self.metrics.request_rejected("invalid")
            raise bad_request(f"the engine refused the request: {e}", code="engine_rejected") from None
        except EngineDead as e:
            self.metrics.request_rejected("engine_dead")
            raise ApiError(503, str(e), code="engine_dead", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except WarmingUp as e:
            self.metrics.request_rejected("warming_up")
            raise ApiError(503, str(e), code="warming_up", type="server_overloaded",
                           headers={"Retry-After": str(e.retry_after_s)}) from None
        self.metrics.request_started(endpoint)
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        self.metrics.prompt_len.observe(len(req.prompt_ids))
        pipe = TextPipeline(self.tokenizer, stop=req.stop, stop_token_ids=req.sampling.stop_token_ids,
                            skip_special_tokens=req.skip_special_tokens, chat=req.chat)
        created = int(time.time())
        if not req.stream:
            async with stream:  # leaving early (disconnect, stop string, error) aborts the request in the engine
                return await self._whole(req, stream, pipe, created, gen)
        try:
            first = await self._next(stream)
        except BaseException:
            stream.abort()
            raise
        gen["ttft"] = _ttft(stream)
        return _SSEResponse(self._events(req, stream, pipe, created, first, gen), stream,
                            {"Cache-Control": "no-cache", "X-Request-Id": stream.request_id})

    @staticmethod
    async def _next(stream: RequestStream) -> Any:
        """The stream's next output; a failure of its request as the ApiError its client should get."""
        try:
            return await stream.__anext__()
        except QueueTimeout as e:
            raise ApiError(503, str(e), code="queue_timeout", type="server_overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineStepError as e:
            raise ApiError(500, str(e), code="engine_step_failed") from None
        except EngineDead as e:
            raise ApiError(503, str(e), code="engine_dead", headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    async def _whole(self, req: GenRequest, stream: RequestStream, pipe: TextPipeline, created: int,
                     gen: dict[str, Any]) -> Response:
        parts: list[str] = []
        cached = 0
        finish = None
        while True:
            try:
                out = await self._next(stream)
            except StopAsyncIteration:
                break
            cached = out.num_cached_tokens
            parts.append(pipe.feed(out.new_token_ids, finished=out.finished, finish_reason=out.finish_reason))
            finish = out.finish_reason
            if pipe.stopped:
                stream.abort("stop")
                break
            if out.finished:
                break
        self.metrics.cached_prompt_tokens.inc(cached)
        gen.update(output_tokens=stream.num_generated, ttft=_ttft(stream))
        usage = usage_of(len(req.prompt_ids), stream.num_generated, cached)
        text = "".join(parts)
        if req.chat:
            body = chat_completion_body(request_id=stream.request_id, model=self.cfg.model_name, created=created,
                                        text=text, thinking=req.thinking, engine_finish_reason=finish,
                                        stopped_by_string=pipe.stopped, usage=usage)
        else:
            body = {"id": stream.request_id, "object": "text_completion", "created": created,
                    "model": self.cfg.model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": finish_reason_of(finish, pipe.stopped, False)}],
                    "usage": usage}
        return _json_response(body, headers={"X-Request-Id": stream.request_id})

    async def _events(self, req: GenRequest, stream: RequestStream, pipe: TextPipeline, created: int, first: Any,
                      gen: dict[str, Any]) -> AsyncIterator[bytes]:
        model = self.cfg.model_name
        chunker = ChatChunker(request_id=stream.request_id, model=model, created=created,
                              thinking=req.thinking) if req.chat else None
        head = {"id": stream.request_id, "object": "text_completion", "created": created, "model": model}
        cached = 0
        finish = None

        def text_chunk(text: str, finish_reason: str | None) -> dict[str, Any]:
            return {**head, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}

        delivered = 0  # tokens in the chunks so far (the engine may be ahead: num_generated)
        out = first
        try:
            while True:
                cached = out.num_cached_tokens
                delivered += len(out.new_token_ids)
                text = pipe.feed(out.new_token_ids, finished=out.finished, finish_reason=out.finish_reason)
                finish = out.finish_reason
                if chunker is not None:
                    chunks = chunker.feed(text, final=out.finished or pipe.stopped)
                else:
                    chunks = [text_chunk(text, None)] if text else []
                if chunks:
                    if req.continuous_usage:
                        usage = usage_of(len(req.prompt_ids), delivered, cached)
                        chunks = [{**c, "usage": usage} for c in chunks]
                    yield b"".join(sse(c) for c in chunks)
                if pipe.stopped:
                    stream.abort("stop")
                    break
                if out.finished:
                    break
                try:
                    out = await self._next(stream)
                except StopAsyncIteration:
                    break
            self.metrics.cached_prompt_tokens.inc(cached)
            tool_calls = chunker is not None and chunker.num_tool_calls > 0
            reason = finish_reason_of(finish, pipe.stopped, tool_calls)
            tail = [chunker.final(reason) if chunker is not None else text_chunk("", reason)]
            usage = usage_of(len(req.prompt_ids), stream.num_generated, cached)
            if req.continuous_usage:
                tail[0]["usage"] = usage
            if req.include_usage:
                tail.append(chunker.usage(usage) if chunker is not None else {**head, "choices": [], "usage": usage})
            yield b"".join(sse(c) for c in tail) + b"data: [DONE]\n\n"
        except ApiError as e:  # the headers are out: the error can only go in the stream
            yield sse(e.body()) + b"data: [DONE]\n\n"
        except Exception:
            log.exception("streaming %s failed", stream.request_id)
            err = ApiError(500, "internal server error; see the server log", code="internal_error")
            yield sse(err.body()) + b"data: [DONE]\n\n"
        finally:
            gen["output_tokens"] = stream.num_generated


def _ttft(stream: RequestStream) -> float | None:
    return None if stream.first_token_time is None else stream.first_token_time - stream.arrival


def create_app(async_engine: AsyncEngine, *, model_name: str, metrics: ServingMetrics | None = None,
               media: MediaConfig | None = None) -> Any:
    """The ASGI application; its lifespan starts the engine thread and stops it at shutdown. media: the image
    limits (`serving.media.MediaConfig`; None: the defaults)."""
    return OpenAIServer(async_engine, model_name=model_name, metrics=metrics, media=media).app


def uvicorn_config(app: Any, *, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's settings for this server: its own access log (with token counts) replaces uvicorn's."""
    return uvicorn.Config(app, host=host, port=port, lifespan="on", access_log=False, log_config=None,
                          log_level=log_level, timeout_keep_alive=30, server_header=False)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free one), so the port is known before the server runs."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class BackgroundServer:
    """The server on uvicorn in a background thread (tests, the bench smoke run, notebooks).

        with BackgroundServer(engine, model_name="tiny") as srv:
            openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x")
    """

    def __init__(self, engine: Any, *, model_name: str, host: str = "127.0.0.1", port: int = 0,
                 metrics: ServingMetrics | None = None, max_queue_wait_s: float | None = None,
                 warmup: bool = False, staged_warmup: bool = False, media: MediaConfig | None = None) -> None:
        self.metrics = metrics or ServingMetrics(model_name)
        self.media = media
        self.async_engine = AsyncEngine(engine, metrics=self.metrics, max_queue_wait_s=max_queue_wait_s,
                                        warmup=warmup, staged_warmup=staged_warmup)
        self.model_name = model_name
        self.host = host
        self.port = port
        self._server: uvicorn.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "BackgroundServer":
        sock = bind(self.host, self.port)
        self.port = sock.getsockname()[1]
        app = create_app(self.async_engine, model_name=self.model_name, metrics=self.metrics, media=self.media)
        self._server = uvicorn.Server(uvicorn_config(app, host=self.host, port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._main, args=(sock,), name="dsv41-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start within {timeout_s} s: {self._error!r}")
            time.sleep(0.01)
        return self

    def _main(self, sock: socket.socket) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._server.serve(sockets=[sock]))
        except BaseException as e:
            self._error = e
            log.exception("the background server stopped with an error")
        finally:
            loop.close()

    def run(self, coro: Any, timeout_s: float = 60.0) -> Any:
        """Runs a coroutine on the server's loop and waits for it (e.g. `srv.run(srv.async_engine.stats())`)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def stop(self) -> None:
        if self._server is not None and self._thread is not None and self._thread.is_alive():
            self._server.should_exit = True
            self._thread.join(60)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
