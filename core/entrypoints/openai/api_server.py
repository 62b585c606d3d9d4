"""`turnout serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over AsyncLLM.

/v1/completions, /v1/chat/completions, /v1/models (behind --api-key when given), /health, /version,
/metrics. A client that disconnects has its requests aborted; SIGINT/SIGTERM start a drain: the socket
keeps accepting, and answers new requests 503 (code server_shutting_down), while the running ones get
--shutdown-timeout seconds to finish; the rest end with that code, then the server stops the engine's
workers and exits. A second signal ends the drain at once.
/openapi.json documents every body, request and response, from the models in protocol.py.
/v1/explain serves what selection chose and why (`turnout explain --json`); / serves the chat page
(turnout.entrypoints.openai.web) unless --no-web-page.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hmac
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

import turnout
from turnout import envs
from turnout.config import EngineConfig
from turnout.engine.async_llm import AsyncLLM
from turnout.entrypoints.openai.explain import ExplainResponse
from turnout.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ErrorResponse,
    ModelList,
    OpenAIError,
    VersionResponse,
    parse,
)
from turnout.entrypoints.openai.serving_chat import OpenAIServingChat
from turnout.entrypoints.openai.serving_completion import OpenAIServingCompletion
from turnout.entrypoints.openai.web import chat_page
from turnout.errors import TurnoutError
from turnout.loader.default_model import DEFAULT_MODEL_NAME
from turnout.metrics import PrometheusStatLogger
from turnout.tool_parsers import ToolParser, get_tool_parser, tool_parser_names

logger = logging.getLogger("turnout")
DRAIN_BACKSTOP_S = 5.0  # past the drain's deadline, the server stops even if the engine has not answered


def build_app(
    engine: AsyncLLM,
    model_names: list[str],
    api_key: str | None,
    metrics: PrometheusStatLogger,
    tool_parser: type[ToolParser] | None = None,
    enable_auto_tool_choice: bool = False,
    *,
    explain: Callable[[], dict[str, Any]],
    web_page: bool = True,
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        logger.info("shutting down: stopping the engine")
        engine.shutdown()

    app = FastAPI(title="turnout", version=turnout.__version__, lifespan=lifespan)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    completion = OpenAIServingCompletion(engine, model_names)
    chat = OpenAIServingChat(engine, model_names, tool_parser, enable_auto_tool_choice)
    created = int(time.time())

    @app.post(
        "/v1/completions",
        response_model=None,
        openapi_extra=_request_body(CompletionRequest),
        responses=_generation_responses(CompletionResponse, CompletionStreamResponse),
    )
    async def completions(request: Request) -> Any:
        req = parse(CompletionRequest, await request.body())
        return await _cancel_on_disconnect(request, completion.create(req))

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        openapi_extra=_request_body(ChatCompletionRequest),
        responses=_generation_responses(ChatCompletionResponse, ChatCompletionStreamResponse),
    )
    async def chat_completions(request: Request) -> Any:
        req = parse(ChatCompletionRequest, await request.body())
        return await _cancel_on_disconnect(request, chat.create(req))

    @app.get(
        "/v1/models",
        response_model=None,
        responses={200: _json(ModelList, "The served models"), **_errors(401)},
    )
    async def models() -> Any:
        card = {"object": "model", "created": created, "owned_by": "turnout"}
        data = [{**card, "id": n, "max_model_len": engine.max_model_len} for n in model_names]
        return {"object": "list", "data": data}

    @app.get("/health", responses={200: {"description": "The engine is up (no body)"}, **_errors(503)})
    async def health() -> Response:
        if engine.dead:
            err = OpenAIError(503, engine.dead, "service_unavailable_error", code="engine_dead")
            return JSONResponse(err.body(), err.status)
        if engine.draining:
            why = "the server is shutting down; retry elsewhere"
            err = OpenAIError(503, why, "service_unavailable_error", code="server_shutting_down")
            return JSONResponse(err.body(), err.status)
        return Response(status_code=200)

    @app.get("/version", response_model=None, responses={200: _json(VersionResponse, "turnout's version")})
    async def version() -> Any:
        return {"version": turnout.__version__}

    @app.get("/metrics", responses={200: _METRICS})
    async def prometheus() -> Response:
        return Response(metrics.expose(), media_type=CONTENT_TYPE_LATEST)

    # selection is a function of the config, which a server keeps
    explained = functools.cache(lambda: ExplainResponse.model_validate(explain()))

    @app.get(
        "/v1/explain",
        response_model=None,
        responses={200: _json(ExplainResponse, "What selection chose and why"), **_errors(401, 500)},
    )
    async def explain_selection() -> Any:
        """What selection chose for the served engine and why: `turnout explain --json`'s document."""
        return await asyncio.to_thread(explained)

    if web_page:
        html, csp = chat_page()

        @app.get("/", include_in_schema=False)
        async def page() -> HTMLResponse:
            return HTMLResponse(html, headers={"Content-Security-Policy": csp, "Cache-Control": "no-cache"})

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            OpenAIError(e.status_code, f"{request.url.path}: {e.detail}", kind).body(), e.status_code
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("request %s failed", request.url.path)
        return JSONResponse(OpenAIError(500, f"internal error: {e}", "server_error").body(), 500)

    app.openapi = functools.partial(_openapi, app.openapi)  # type: ignore[method-assign]
    return app


# ---- /openapi.json: the handlers parse bodies themselves (for OpenAI's error bodies), so the routes name
# their models by $ref and the components are added here ----
_REF = "#/components/schemas/{model}"
_MODES: dict[type[BaseModel], JsonSchemaMode] = {
    CompletionRequest: "validation",
    ChatCompletionRequest: "validation",
    **dict.fromkeys(
        (
            CompletionResponse,
            CompletionStreamResponse,
            ChatCompletionResponse,
            ChatCompletionStreamResponse,
            ModelList,
            VersionResponse,
            ExplainResponse,
            ErrorResponse,
        ),
        "serialization",
    ),
}
_ERRORS = {
    400: "Invalid JSON, or a value out of range or unsupported (`param` names the field)",
    401: "A missing or wrong API key (with --api-key): every /v1/ path",
    404: "The model is not served here",
    413: "The prompt and max_tokens do not fit in the context (code context_length_exceeded)",
    422: "A field of the wrong JSON type, an unknown field or a missing one",
    500: "A bug: an internal error",
    503: "The engine is dead (code engine_dead), its waiting queue is full (code server_busy), or the server "
    "is shutting down (code server_shutting_down)",
}
_METRICS = {
    "description": "Prometheus metrics",
    "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    assert model in _MODES, f"{model.__name__} is not among the documented models"
    return {"$ref": _REF.format(model=model.__name__)}


def _json(model: type[BaseModel], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(model)}}}


def _errors(*statuses: int) -> dict[int | str, Any]:
    return {s: _json(ErrorResponse, _ERRORS[s]) for s in statuses}


def _request_body(model: type[BaseModel]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": _ref(model)}}}}


def _generation_responses(body: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, Any]:
    """200: the body, or with stream: true server-sent events, as OpenAI documents them: each `data:`
    holds a chunk (or an error body, the last event of a stream that failed), then `data: [DONE]`."""
    ok = _json(body, f"The {body.__name__}; with stream: true, server-sent events of {chunk.__name__}")
    events = {"schema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}}
    ok["content"]["text/event-stream"] = events
    return {200: ok, **_errors(400, 401, 404, 413, 422, 500, 503)}


@functools.cache
def _schemas() -> dict[str, Any]:
    _, top = models_json_schema(list(_MODES.items()), ref_template=_REF)
    return top["$defs"]


def _openapi(generate: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """FastAPI's document, with the components its routes name."""
    doc = generate()
    doc.setdefault("components", {}).setdefault("schemas", {}).update(_schemas())
    return doc


async def _cancel_on_disconnect(request: Request, handler: Awaitable[Any]) -> Any:
    """Run the handler until it answers or the client goes away; then cancel it, which aborts its
    requests. (A streaming answer watches for the disconnect itself, in StreamingResponse.)"""
    task = asyncio.ensure_future(handler)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # a no-op once it is done
    if not task.done() or task.cancelled():
        return Response(status_code=499)  # nobody reads it
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ApiKeyMiddleware:
    """Every /v1/ path needs 'Authorization: Bearer <key>'; the rest (/health, /metrics, ...) stay open."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                err = OpenAIError(
                    401,
                    "missing or wrong API key; send 'Authorization: Bearer <key>'",
                    "authentication_error",
                    code="invalid_api_key",
                )
                return await JSONResponse(err.body(), 401)(scope, receive, send)
        await self.app(scope, receive, send)


class Server(uvicorn.Server):
    """uvicorn's server, whose first SIGINT/SIGTERM starts the engine's drain and keeps listening: uvicorn's
    own shutdown (which closes the socket) begins once the engine holds no request, or DRAIN_BACKSTOP_S
    after the drain's deadline. A second signal moves the deadline to now; a third SIGINT is uvicorn's."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, grace: float) -> None:
        super().__init__(config)
        self.engine, self.grace = engine, grace
        self.stop_at: float | None = None  # set by the first signal

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.stop_at is None or not self.should_exit:
            grace = self.grace if self.stop_at is None else 0.0
            self.stop_at = time.monotonic() + grace + DRAIN_BACKSTOP_S
            self.engine.begin_shutdown(grace)
        else:
            super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.stop_at is not None and (self.engine.drained or time.monotonic() > self.stop_at):
            self.should_exit = True
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """As uvicorn's, except that the signal is not raised again after a graceful exit: exit status 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise TurnoutError(
            f"cannot listen on {host}:{port} ({e.strerror}); pick another --host or --port"
        ) from None
    sock.set_inheritable(True)
    return sock


def _check(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise TurnoutError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_waiting_requests < 0:
        raise TurnoutError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    if args.shutdown_timeout < 0:
        raise TurnoutError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        names = ", ".join(tool_parser_names())
        raise TurnoutError(f"--enable-auto-tool-choice needs --tool-call-parser NAME (installed: {names})")


def run_server(args: argparse.Namespace, config: EngineConfig, explain: Callable[[], dict[str, Any]]) -> int:
    """Serve until SIGINT/SIGTERM; the socket is bound before the model loads, so a taken port fails fast.
    explain() returns `turnout explain --json`'s document for config."""
    _check(args)
    parser = get_tool_parser(args.tool_call_parser) if args.tool_call_parser else None
    sock = _listen(args.host, args.port)
    names = args.served_model_name or [config.model or DEFAULT_MODEL_NAME]
    metrics = PrometheusStatLogger(names[0])
    try:
        if config.tune == "auto":  # where no record matches, measure before the engine core starts
            from turnout.tuning.tuner import tune_if_unseen

            tune_if_unseen(config)
        engine = AsyncLLM(config, args.max_waiting_requests, [metrics])
    except BaseException:
        sock.close()
        raise
    try:
        key = args.api_key or envs.API_KEY.value or None
        app = build_app(
            engine, names, key, metrics, parser, args.enable_auto_tool_choice,
            explain=explain, web_page=args.web_page,
        )  # fmt: skip
        uconfig = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=int(args.shutdown_timeout) + 5,  # a backstop: the engine drains first
        )
        server = Server(uconfig, engine, args.shutdown_timeout)
        host, port = sock.getsockname()[:2]
        info = engine.info
        logger.info(
            "serving %s: backend %s, model %s (%s), executor %s, graph mode %s, engine core in a %s; "
            "http://%s:%d/v1",
            names[0], info.backend, info.model, info.architecture, info.executor, info.graph_mode,
            engine.core_location, host, port,
        )  # fmt: skip
        if args.web_page:
            logger.info("chat page: http://%s:%d/", host, port)
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
    return 0
