"""The gateway's ASGI application: OpenAI's routes, the stream route, the probes. Every
route answers errors as OpenAI's error objects; a route under `/v1` needs a listed API
key when a keys file is set."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from trtllm_worker.client import Client, ServiceUnavailable
from trtllm_worker.client.batches import settings_token_text
from trtllm_worker.config import Settings
from trtllm_worker.connect.grants import GATEWAY, redis_refusal
from trtllm_worker.contract.openai import CHAT_COMPLETIONS, COMPLETIONS
from trtllm_worker.contract.priority import MAX_PRIORITY
from trtllm_worker.gateway import answers, streams
from trtllm_worker.gateway.admission import Admission
from trtllm_worker.gateway.errors import APIError, not_found, unauthorized, unavailable
from trtllm_worker.gateway.files import FilesAndBatches
from trtllm_worker.gateway.grants import refused_commands
from trtllm_worker.gateway.keys import Caller, KeyRing
from trtllm_worker.gateway.metrics import GatewayMetrics
from trtllm_worker.gateway.reader import StreamHub

log = logging.getLogger(__name__)

CLIENT_NAME = "trtllm-worker-gateway"
Handler = Callable[[Request, Caller], Awaitable[Response]]


class Gateway:
    """The parts the routes share, built once per process."""

    def __init__(self, settings: Settings, keys: KeyRing) -> None:
        self.settings = settings
        self.keys = keys
        self.metrics = GatewayMetrics()
        self.client = Client(settings, client_name=CLIENT_NAME)
        self.model = settings.served_model_name
        self.started = int(time.time())
        self.reader = StreamHub(self.client)
        self.answering = answers.Answering(
            client=self.client,
            reader=self.reader,
            admission=Admission(self.client, settings.gateway_max_queued),
            metrics=self.metrics,
            model=self.model,
            token_text=settings_token_text(settings),
            background=set(),
        )
        below_interactive = min(settings.preempt_priority - 1, MAX_PRIORITY)
        self.files = FilesAndBatches(self.client, max(below_interactive, 0))
        self.grants_held = False
        """Whether the grants probe found every command allowed (asked once)."""

    async def grants_refusal(self) -> str | None:
        """One line naming the commands the gateway's Redis user may not run, or None;
        `ServiceUnavailable` when Redis does not answer. Probed until it passes once."""
        if self.grants_held:
            return None
        redis = await self.client.answering_redis()
        try:
            refused = await refused_commands(redis, self.settings.stream_prefix)
        except (RedisError, OSError) as exc:  # lost, or in a state (loading, busy)
            raise ServiceUnavailable(f"Redis does not answer: {exc}") from None
        if refused:
            return redis_refusal(self.settings, refused, GATEWAY)
        self.grants_held = True
        return None

    async def aclose(self) -> None:
        await self.files.close()
        await self.reader.aclose()
        await self.client.aclose()

    def caller(self, request: Request) -> Caller:
        """The request's caller from its bearer key (401 if not listed)."""
        if self.keys.is_open:
            return self.keys.open_caller
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            key = ""
            if request.url.path.startswith("/v1/streams/"):
                # a browser's EventSource cannot set headers: the key may come as a query
                # parameter there (the gateway logs no query strings)
                key = request.query_params.get("api_key", "")
            if not key:
                raise unauthorized(
                    "You didn't provide an API key. You need to provide your API key in an "
                    "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
                )
        caller = self.keys.lookup(key.strip())
        if caller is None:
            raise unauthorized("Incorrect API key provided.")
        return caller

    def route(self, name: str, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        """`handler` behind the key check, its errors as OpenAI's, counted by status."""

        async def endpoint(request: Request) -> Response:
            try:
                response = await handler(request, self.caller(request))
            except APIError as exc:
                response = exc.response()
            except ServiceUnavailable as exc:
                response = unavailable(str(exc)).response()
            except (RedisConnectionError, RedisTimeoutError) as exc:
                # Redis lost in the middle of a route (files, batches): 503, which the
                # SDKs retry, not a 500
                response = unavailable(f"Redis does not answer: {exc}").response()
            self.metrics.requests.labels(name, str(response.status_code)).inc()
            return response

        return endpoint

    # -- routes -------------------------------------------------------------------------

    async def chat(self, request: Request, caller: Caller) -> Response:
        return await answers.create(self.answering, CHAT_COMPLETIONS, request, caller)

    async def completions(self, request: Request, caller: Caller) -> Response:
        return await answers.create(self.answering, COMPLETIONS, request, caller)

    def _model(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": self.started,
                "owned_by": "trtllm-worker"}  # fmt: skip

    async def models(self, request: Request, caller: Caller) -> Response:
        return JSONResponse({"object": "list", "data": [self._model()]})

    async def model_info(self, request: Request, caller: Caller) -> Response:
        if request.path_params["model"] != self.model:
            raise not_found(
                f"The model `{request.path_params['model']}` does not exist or you do not "
                "have access to it.",
                code="model_not_found",
            )
        return JSONResponse(self._model())

    async def stream(self, request: Request, caller: Caller) -> Response:
        return await streams.stream_events(
            self.reader, self.metrics, request, request.path_params["request_id"]
        )

    async def files_list(self, request: Request, caller: Caller) -> Response:
        return await self.files.list_files(request, caller)

    async def upload(self, request: Request, caller: Caller) -> Response:
        return await self.files.upload(request, caller)

    async def file(self, request: Request, caller: Caller) -> Response:
        return await self.files.file(request.path_params["file_id"], caller)

    async def file_content(self, request: Request, caller: Caller) -> Response:
        return await self.files.content(request.path_params["file_id"], caller)

    async def delete_file(self, request: Request, caller: Caller) -> Response:
        return await self.files.delete(request.path_params["file_id"], caller)

    async def create_batch(self, request: Request, caller: Caller) -> Response:
        return await self.files.create_batch(request, caller)

    async def batch(self, request: Request, caller: Caller) -> Response:
        return await self.files.retrieve_batch(request.path_params["batch_id"], caller)

    async def batches(self, request: Request, caller: Caller) -> Response:
        return await self.files.list_batches(request, caller)

    async def cancel_batch(self, request: Request, caller: Caller) -> Response:
        return await self.files.cancel_batch(request.path_params["batch_id"], caller)

    # -- probes -------------------------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        return PlainTextResponse("ok\n")

    async def readyz(self, request: Request) -> Response:
        """Ready when Redis answers, its user holds the gateway's grants and the broker
        connection is open."""
        try:
            await self.client.answering_redis()
            refusal = await self.grants_refusal()
            await self.client._amqp()
        except Exception as exc:
            return PlainTextResponse(f"not ready: {exc}\n", status_code=503)
        if refusal is not None:
            return PlainTextResponse(f"not ready: {refusal}\n", status_code=503)
        return PlainTextResponse("ready\n")

    async def metrics_page(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def routes(self) -> list[Route]:
        r = self.route
        return [
            Route("/v1/chat/completions", r("chat.completions", self.chat), methods=["POST"]),
            Route("/v1/completions", r("completions", self.completions), methods=["POST"]),
            Route("/v1/models", r("models", self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", r("models", self.model_info), methods=["GET"]),
            Route("/v1/streams/{request_id}", r("streams", self.stream), methods=["GET"]),
            Route("/v1/files", r("files", self.upload), methods=["POST"]),
            Route("/v1/files", r("files", self.files_list), methods=["GET"]),
            Route("/v1/files/{file_id}", r("files", self.file), methods=["GET"]),
            Route("/v1/files/{file_id}", r("files", self.delete_file), methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", r("files", self.file_content), methods=["GET"]),
            Route("/v1/batches", r("batches", self.create_batch), methods=["POST"]),
            Route("/v1/batches", r("batches", self.batches), methods=["GET"]),
            Route("/v1/batches/{batch_id}", r("batches", self.batch), methods=["GET"]),
            Route(
                "/v1/batches/{batch_id}/cancel", r("batches", self.cancel_batch), methods=["POST"]
            ),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
            Route("/metrics", self.metrics_page, methods=["GET"]),
        ]


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 and 405 as OpenAI answers an unknown URL."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    message = (
        f"Invalid URL ({request.method} {request.url.path})"
        if status in (404, 405)
        else "The server had an error while processing your request."
    )
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": None}},
        status_code=status,
    )


def cors_origins(setting: str) -> list[str]:
    return [origin.strip() for origin in setting.split(",") if origin.strip()]


def create_app(settings: Settings, keys: KeyRing | None = None) -> Starlette:
    """The application for `settings` (keys from `WORKER_GATEWAY_KEYS_FILE` unless given)."""
    if keys is None:
        keys = KeyRing(
            settings.gateway_keys_file, Caller(None, min(settings.preempt_priority, MAX_PRIORITY))
        )
    gateway = Gateway(settings, keys)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await gateway.aclose()

    middleware = []
    origins = cors_origins(settings.gateway_cors_origins)
    if origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=origins,
                allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                # any request header: the OpenAI SDKs send their own (X-Stainless-*,
                # OpenAI-Organization, ...), which a preflight that lists only ours
                # refuses, and a page of a listed origin holds its key anyway
                allow_headers=["*"],
                expose_headers=[answers.REQUEST_ID_HEADER],
            )
        )
    app = Starlette(
        routes=gateway.routes(),
        middleware=middleware,
        exception_handlers={HTTPException: _http_error, Exception: _http_error},
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    return app
