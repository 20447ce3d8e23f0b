"""The OpenAI-compatible API: ``create_app(settings, model_info, client) -> FastAPI``.

HTTP endpoints (shapes of the OpenAI API reference and of vLLM's OpenAI server):

- ``POST /v1/completions``, ``POST /v1/chat/completions``: JSON, or Server-Sent Events
  with ``"stream": true`` (``data: {chunk}`` lines, an optional usage chunk with
  ``stream_options.include_usage``, then ``data: [DONE]``).
- ``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /health`` (200 when the engine is ready).
- ``GET /metrics``: Prometheus text format, vLLM's metric names (see ``gateway/metrics.py``).
- ``/v1/stream``: several streaming requests over one WebSocket (``gateway/websocket.py``).
- ``/v1/files``, ``/v1/batches``: OpenAI's Files and Batch API on JetStream (``gateway/batch/``).

Every error body is OpenAI-shaped (``gateway/errors.py``): invalid bodies are 400 (never
FastAPI's 422), an unknown model is 404, an engine failure keeps its status (500 when
unknown). The request logic behind the routes is ``gateway/serving.py``, answered over HTTP by
``gateway/http_handler.py``. With ``api_key`` set, ``/v1`` needs a bearer key
(``gateway/auth.py``).
"""

from __future__ import annotations

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.auth import APIKeyMiddleware, parse_api_keys
from gateway.batch.routes import router as batch_router
from gateway.errors import APIError, validation_error
from gateway.http_handler import handle_http
from gateway.metrics import CONTENT_TYPE
from gateway.protocol.requests import ChatCompletionRequest, CompletionRequest
from gateway.protocol.responses import ModelCard, ModelList
from gateway.serving import OpenAIServing
from gateway.websocket import handle_websocket
from shared.config import Settings
from shared.engine_client import EngineClient
from shared.logging import get_logger
from shared.model_source import ModelInfo
from shared.pings import NO_EXECUTOR_GROUP, engine_missing

log = get_logger(__name__)


def _error_response(exc: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def create_app(settings: Settings, model_info: ModelInfo, client: EngineClient) -> FastAPI:
    """The FastAPI app of one gateway, serving ``model_info.name`` through ``client``."""
    app = FastAPI(title="pagedllm", description="OpenAI-compatible API of pagedllm", version="0.1.0")
    if keys := parse_api_keys(settings.api_key):  # inside CORS: a refusal still carries its headers
        app.add_middleware(APIKeyMiddleware, keys=keys)
    origins = [o.strip() for o in settings.allowed_origins.split(",") if o.strip()]
    if origins:  # browsers' preflight requests (OPTIONS) and CORS headers, as vLLM's defaults
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])
    serving = OpenAIServing(settings, model_info, client)
    app.state.serving = serving
    app.state.settings = settings
    app.state.batch_store = None  # the gateway service opens it on JetStream (503 without)
    app.include_router(batch_router)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError.of(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return _error_response(error, exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("request_failed", path=request.url.path, error=repr(exc))
        return _error_response(APIError.of(500, "internal server error"))

    @app.get("/health")
    async def health() -> Response:
        """200 when the engine can serve: NATS is up, every engine service answers a ping
        (each of the ``num_detokenizer_shards`` detokenizer shards) and the scheduler has an
        executor group; else 503 naming what is missing (the engine is degraded: a service
        restarting), or that the gateway drains before it stops."""
        if serving.draining:
            raise APIError.of(503, "the server is shutting down", code="server_shutting_down")
        if not client.connected:
            raise APIError.of(503, "the NATS connection is down", code="service_unavailable")
        if missing := await engine_missing(client.bus, model_info.name, settings.num_detokenizer_shards):
            silent = [name for name in missing if name != NO_EXECUTOR_GROUP]
            parts = ([f"not answering: {', '.join(silent)}"] if silent else []) + (
                ["no executor group registered"] if NO_EXECUTOR_GROUP in missing else [])
            raise APIError.of(503, f"the engine is degraded ({'; '.join(parts)}); requests in flight wait for it",
                              code="service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus metrics (vLLM's names): engine state from the scheduler's statistics,
        request latencies and token counts measured by this gateway."""
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        """The one served model."""
        return ModelList(data=[serving.model_card()])

    @app.get("/v1/models/{model:path}", response_model=ModelCard)
    async def retrieve_model(model: str) -> ModelCard:
        """The served model by name (404 for any other)."""
        serving.check_model(model)
        return serving.model_card()

    @app.post("/v1/completions", response_model=None)
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        """OpenAI ``POST /v1/completions`` (JSON, or SSE with ``stream``)."""
        return await handle_http(serving, body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI ``POST /v1/chat/completions`` (JSON, or SSE with ``stream``)."""
        return await handle_http(serving, body, request)

    @app.websocket("/v1/stream")
    async def stream(ws: WebSocket) -> None:
        """Several streaming requests over one connection (``gateway/websocket.py``)."""
        await handle_websocket(serving, ws)

    return app
