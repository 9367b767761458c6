"""The Starlette app: routes, API-key check, OpenAI-shaped errors, and model loading in the
background so /health answers 503 "loading" until the engine is ready."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from streamsd.engine.async_engine import AsyncEngine
from streamsd.engine.core import EngineFactory
from streamsd.engine.process import ProcessEngine
from streamsd.server.auth import ApiKeys
from streamsd.server.fingerprint import system_fingerprint
from streamsd.server.metrics import Metrics
from streamsd.server.openai_routes import chat_completions, completions, model, models
from streamsd.server.origins import OriginPolicy
from streamsd.server.prompts import PromptEncoder
from streamsd.server.state import ApiError, ServerState
from streamsd.server.tokenize_routes import detokenize, tokenize, version
from streamsd.server.ws import websocket_endpoint

log = logging.getLogger("streamsd")


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.streamsd
    if state.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if state.load_error is not None or state.engine is None:
        status = "failed" if state.load_error else "loading"
        return JSONResponse({"status": status, "error": state.load_error}, status_code=503)
    return JSONResponse({"status": "ok", "model": state.served_model_name})


async def unknown_route(request: Request) -> Response:
    raise ApiError(404, f"no route {request.method} {request.url.path}")


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)


async def client_gone(request: Request, exc: Exception) -> Response:
    # The client hung up (mid-body, or while its answer was computed): nobody reads this answer.
    log.debug("client left %s %s before its answer", request.method, request.url.path)
    return Response(status_code=499)


async def server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return JSONResponse(ApiError(500, "internal server error").body(), status_code=500)


# What the API key guards besides /v1/: the tokenisation routes run the model's tokenizer.
KEYED_PATHS = ("/tokenize", "/detokenize")


class ApiKeyMiddleware:
    """Bearer-token check on the HTTP API, each request counted under its key's name; the WebSocket
    route checks its own at connect."""

    def __init__(self, app: ASGIApp, keys: ApiKeys | None, metrics: Metrics):
        self.app, self.keys, self.metrics = app, keys, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if self.keys and scope["type"] == "http" and (path.startswith("/v1/") or path in KEYED_PATHS):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            name = self.keys.bearer(header)
            if name is None:
                err = ApiError(401, "a valid API key is required (Authorization: Bearer <key>)")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
            self.metrics.key_requests.labels(key=name).inc()
        await self.app(scope, receive, send)


def create_app(state: ServerState, engine_factory: EngineFactory, web_dir: Path | None = None,
               origins: OriginPolicy = OriginPolicy(), engine_process: bool = False) -> Starlette:
    """`engine_process`: the engine runs in a process of its own (engine/process.py); `engine_factory`
    must then pickle (a module-level function, or a functools.partial of one)."""
    metrics = Metrics(state)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loader = asyncio.create_task(_load(state, engine_factory, metrics, engine_process))
        try:
            yield
        finally:
            loader.cancel()
            with contextlib.suppress(BaseException):
                await loader
            if state.engine is not None:
                await state.engine.close()
            if state.prompts is not None:
                state.prompts.close()

    routes: list[Route | WebSocketRoute | Mount] = [
        Route("/health", health),
        Route("/metrics", metrics.endpoint),
        Route("/version", version),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/models", models),
        Route("/v1/models/{model_id:path}", model),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        WebSocketRoute("/v1/ws", websocket_endpoint),
        Route("/v1/{path:path}", unknown_route, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
    ]
    if web_dir is not None and (web_dir / "index.html").exists():
        routes.append(Mount("/", StaticFiles(directory=str(web_dir), html=True), name="web"))
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[*origins.middleware(), Middleware(ApiKeyMiddleware, keys=state.api_keys, metrics=metrics)],
        exception_handlers={ApiError: api_error, HTTPException: http_error, ClientDisconnect: client_gone,
                            Exception: server_error},
    )
    app.state.streamsd = state
    app.state.metrics = metrics
    return app


async def _load(state: ServerState, factory: EngineFactory, metrics: Metrics, engine_process: bool) -> None:
    launch = ProcessEngine.launch if engine_process else AsyncEngine.launch
    try:
        # A follower rank that exits, or the engine process, ends the server (serve.py exits on load_error).
        engine = await launch(factory, state.stream_interval, state.fail)
    except Exception as exc:
        log.error("loading the model failed: %s", exc)
        state.fail(f"loading the model failed: {exc}")
        return
    metrics.engine_loaded(engine.info)
    engine.observers.append(metrics.observe)
    engine.step_observers.append(metrics.observe_step)
    await engine.start()
    # anyio imports its event-loop backend when it is first asked for one, which a streamed answer's
    # task group is: ~20 ms of imports that would otherwise land in the first user's time to first token.
    await anyio.sleep(0)
    state.prompts = PromptEncoder(engine.text, engine.info, metrics.tokenize.observe)
    await state.prompts.warm()
    state.system_fingerprint = system_fingerprint(engine.info, state.served_model_name)
    state.engine = engine
    log.info("ready: serving %s", state.served_model_name)
