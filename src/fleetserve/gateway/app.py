"""The OpenAI-compatible gateway: API keys, rate limits, admission, endpoint picking, streaming.

- ``GET /v1/models``; ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``.
- API keys are Bearer tokens, stored hashed, each with its models and request/token limits.
- The engine ignores the request's ``"model"``: the gateway checks it (404 in OpenAI's shape).
- A request that fails before its first byte reached the client is retried once on another
  replica; after that, never. ``stream: true`` passes the engine's server-sent events through
  chunk by chunk; a client that disconnects closes the upstream request, which cancels it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from fleetserve.errors import FleetserveError, InternalError
from fleetserve.gateway.admission import Admission, AdmissionPolicy, GatewayRejection
from fleetserve.gateway.endpoints import EndpointTable, Route
from fleetserve.gateway.picker import Endpoint, Load, pick, prefix_key_for
from fleetserve.gateway.ratelimit import Limits, RateLimiter
from fleetserve.metrics.exposition import FleetMetrics
from fleetserve.routing import engine_auth
from fleetserve.store.credentials import ApiKey
from fleetserve.store.protocols import GatewayStore

log = logging.getLogger("fleetserve.gateway")
T = TypeVar("T")

# Requests larger than this are refused with 413 before they are parsed.
BODY_LIMIT = 8 << 20
# How long a request waits for a replica when none is Ready (starting, or scaled to zero).
HOLD_SECONDS = 30.0
# API-key lookups are cached this long, so the database is not hit on every request.
KEY_CACHE_SECONDS = 5.0
# How often a request waiting on its engine checks that its client is still there.
DISCONNECT_POLL_SECONDS = 0.25
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


def openai_error(
    status: int,
    message: str,
    kind: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An error in OpenAI's JSON shape."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def broken_stream_event(replica: str) -> bytes:
    """The server-sent event that ends a stream whose upstream broke off mid-way."""
    body = {
        "error": {
            "message": f"the upstream stream from replica {replica} broke off before it was complete",
            "type": "upstream_error",
            "param": None,
            "code": "stream_broken",
        }
    }
    return b"\n\ndata: " + json.dumps(body).encode() + b"\n\n"


def _usage_tokens(data: Any) -> int:
    usage = data.get("usage") if isinstance(data, dict) else None
    if isinstance(usage, dict):
        total = usage.get("total_tokens")
        if isinstance(total, int):
            return total
    return 0


def _stream_usage(tail: bytes) -> int:
    """Tokens from the usage chunk near the end of a server-sent event stream, if any."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            with contextlib.suppress(ValueError):
                return _usage_tokens(json.loads(line[6:]))
    return 0


class ClientGone(FleetserveError):
    """The client disconnected before its answer was ready; the upstream request was cancelled."""


class Gateway:
    """The gateway's state: routes, admission, rate limits, in-flight counts, the upstream client."""

    def __init__(
        self,
        store: GatewayStore,
        refresh_seconds: float = 1.0,
        seed: int | None = None,
        metrics: FleetMetrics | None = None,
        engine_waiting: Callable[[str], tuple[float, float] | None] | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics
        # replica → (engine-reported waiting requests, age of that figure in seconds), if known
        self.engine_waiting = engine_waiting
        self.last_request: dict[str, float] = {}
        self.admission = Admission()
        self.table = EndpointTable(store, refresh_seconds=refresh_seconds, on_change=self.admission.notify)
        self.limiter = RateLimiter()
        self.rng = random.Random(seed)
        self.in_flight: dict[str, int] = defaultdict(int)
        self._keys: dict[str, tuple[ApiKey | None, float]] = {}
        self.http: httpx.AsyncClient | None = None

    async def start(self) -> None:
        """Open the upstream client and start following the replicas."""
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=5.0, read=600.0, write=60.0, pool=30.0),
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=200),
        )
        await self.table.refresh()
        self.table.start()

    async def stop(self) -> None:
        """Stop following replicas; close the upstream client."""
        await self.table.stop()
        if self.http is not None:
            await self.http.aclose()

    # --- checks -----------------------------------------------------------------------------------

    async def authenticate(self, request: Request) -> ApiKey | None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        now = time.monotonic()
        cached = self._keys.get(token)
        if cached is not None and cached[1] > now:
            return cached[0]
        key = await run_in_threadpool(self.store.verify_api_key, token)
        if len(self._keys) > 10_000:
            self._keys.clear()
        self._keys[token] = (key, now + KEY_CACHE_SECONDS)
        return key

    def forget_keys(self) -> None:
        """Drop cached API-key lookups (after a revocation): the next request checks the store."""
        self._keys.clear()

    def route_of(self, model: str) -> Route | None:
        return self.table.routes.get(model)

    def _ready(self, model: str) -> int:
        route = self.table.routes.get(model)
        return len(route.endpoints) if route else 0

    def _load(self, replica: str) -> Load:
        """Outstanding work on a replica: the gateway's in-flight count plus the engine's fresh queue."""
        waiting = self.engine_waiting(replica) if self.engine_waiting is not None else None
        if waiting is None:
            return Load(self.in_flight[replica])
        return Load(self.in_flight[replica], int(waiting[0]), waiting[1])

    def _pick(self, model: str, exclude: frozenset[str], prefix: str | None) -> Endpoint | None:
        route = self.table.routes.get(model)
        if route is None:
            return None
        loads = {e.replica: self._load(e.replica) for e in route.endpoints}
        return pick(route.endpoints, loads, self.rng, exclude=exclude, prefix_key=prefix)

    # --- the request -----------------------------------------------------------------------------

    async def handle(self, request: Request, path: str) -> Response:
        started = time.monotonic()
        response = await self._handle(request, path)
        model = getattr(request.state, "model", None)
        if model is not None:
            # A request counts as activity until it is answered, not just when it arrives.
            self.last_request[model] = time.monotonic()
        if self.metrics is not None and model is not None:
            self.metrics.gateway_request(model, response.status_code, time.monotonic() - started)
            self.metrics.set_queue_depth(model, self.admission.depth(model).waiting)
        return response

    async def _handle(self, request: Request, path: str) -> Response:
        key = await self.authenticate(request)
        if key is None:
            return openai_error(
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                "invalid_request_error",
                "invalid_api_key",
            )
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > BODY_LIMIT:
            return openai_error(413, f"Request body larger than {BODY_LIMIT} bytes.", "invalid_request_error")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > BODY_LIMIT:
                return openai_error(
                    413, f"Request body larger than {BODY_LIMIT} bytes.", "invalid_request_error"
                )
        try:
            data = json.loads(body)
        except ValueError:
            return openai_error(400, "The request body is not valid JSON.", "invalid_request_error")
        model = data.get("model") if isinstance(data, dict) else None
        if not isinstance(model, str) or not model:
            return openai_error(
                400, "You must provide a model parameter.", "invalid_request_error", param="model"
            )
        route = self.route_of(model)
        if route is not None:
            request.state.model = model
            self.last_request[model] = time.monotonic()
        if route is None:
            return openai_error(
                404,
                f"The model `{model}` does not exist.",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
        if not key.allows(model):
            return openai_error(
                403,
                f"This API key may not use the model `{model}`.",
                "invalid_request_error",
                "model_not_allowed",
                "model",
            )
        decision = self.limiter.acquire(str(key.id), Limits(key.rpm, key.tpm), time.monotonic())
        if not decision.allowed:
            if self.metrics is not None:
                self.metrics.gateway_rejection(model, "RateLimited")
            which = decision.which.value if decision.which else "requests"
            return openai_error(
                429,
                f"Rate limit reached for {which} per minute on this API key; retry after "
                f"{decision.retry_after_header} s.",
                which,
                "rate_limit_exceeded",
                headers={"Retry-After": str(decision.retry_after_header)},
            )
        stream = bool(data.get("stream"))
        prefix = None
        if route.prefix_affinity:
            prefix = prefix_key_for(data.get("messages") or data.get("prompt") or data.get("input") or "")
        exits = contextlib.AsyncExitStack()
        try:
            await exits.enter_async_context(
                self.admission.slot(
                    model,
                    AdmissionPolicy.of(
                        route.policy, max_concurrency_per_replica=route.concurrency_per_replica
                    ),
                    lambda: self._ready(model),
                    HOLD_SECONDS,
                )
            )
        except GatewayRejection as exc:
            await exits.aclose()
            if self.metrics is not None:
                self.metrics.gateway_rejection(model, type(exc).__name__)
            kind = "overloaded" if exc.status == 429 else "service_unavailable"
            return openai_error(
                exc.status,
                str(exc),
                kind,
                kind,
                headers={"Retry-After": str(max(1, math.ceil(exc.retry_after)))},
            )
        try:
            response = await self._forward(request, key, model, path, body, stream, prefix, exits)
        except ClientGone:
            await exits.aclose()
            return Response(status_code=499)
        except BaseException:
            await exits.aclose()
            raise
        if not isinstance(response, StreamingResponse):
            await exits.aclose()
        return response

    async def _unless_gone(self, request: Request, work: Awaitable[T]) -> T:
        """Await ``work``, cancelling it (and so the upstream request) if the client disconnects."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise ClientGone()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await task

    async def _forward(
        self,
        request: Request,
        key: ApiKey,
        model: str,
        path: str,
        body: bytes,
        stream: bool,
        prefix: str | None,
        exits: contextlib.AsyncExitStack,
    ) -> Response:
        http = self.http
        if http is None:
            raise InternalError("the gateway forwards requests only between start() and stop()")
        tried: set[str] = set()
        last_error = "no replica is ready"
        for _ in range(2):  # the first try and, before any byte reached the client, one retry
            endpoint = self._pick(model, frozenset(tried), prefix)
            if endpoint is None:
                break
            tried.add(endpoint.replica)
            self.in_flight[endpoint.replica] += 1
            upstream = http.build_request(
                "POST",
                endpoint.url + path,
                content=body,
                # The replica's own engine key: the engine refuses any request without it.
                headers={"content-type": "application/json", **engine_auth(endpoint.engine_key)},
            )
            try:
                response = await self._unless_gone(request, http.send(upstream, stream=True))
            except ClientGone:
                self.in_flight[endpoint.replica] -= 1
                raise
            except httpx.TransportError as exc:
                self.in_flight[endpoint.replica] -= 1
                last_error = f"replica {endpoint.replica}: {exc.__class__.__name__}"
                continue
            if response.status_code >= 500:
                await response.aclose()
                self.in_flight[endpoint.replica] -= 1
                last_error = f"replica {endpoint.replica} answered {response.status_code}"
                continue
            headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}
            if not stream:
                try:
                    content = await self._unless_gone(request, response.aread())
                except httpx.TransportError as exc:  # failed mid-body: nothing reached the client yet
                    last_error = f"replica {endpoint.replica}: {exc.__class__.__name__}"
                    continue
                finally:
                    await response.aclose()
                    self.in_flight[endpoint.replica] -= 1
                with contextlib.suppress(ValueError):
                    self.limiter.record_tokens(
                        str(key.id), _usage_tokens(json.loads(content)), time.monotonic()
                    )
                return Response(content, status_code=response.status_code, headers=headers)
            return StreamingResponse(
                self._relay(response, endpoint, key, exits, model),
                status_code=response.status_code,
                headers=headers,
            )
        return openai_error(
            503,
            f"No replica of `{model}` could serve the request ({last_error}).",
            "service_unavailable",
            "no_replica",
            headers={"Retry-After": "1"},
        )

    async def _relay(
        self,
        response: httpx.Response,
        endpoint: Endpoint,
        key: ApiKey,
        exits: contextlib.AsyncExitStack,
        model: str,
    ) -> AsyncIterator[bytes]:
        """Pass the engine's events through as they come; closing this closes the upstream."""
        tail = b""
        try:
            async for chunk in response.aiter_raw():
                tail = (tail + chunk)[-8192:]
                yield chunk
        except httpx.TransportError as exc:
            # Never end a broken stream as if it were complete: the client gets an error event
            # (OpenAI clients raise on it) and no [DONE].
            log.warning("stream from %s broke off: %s", endpoint.replica, exc)
            yield broken_stream_event(endpoint.replica)
        finally:
            await response.aclose()
            self.in_flight[endpoint.replica] -= 1
            self.limiter.record_tokens(str(key.id), _stream_usage(tail), time.monotonic())
            self.last_request[model] = time.monotonic()  # a stream is activity until it ends
            await exits.aclose()

    async def models(self, request: Request) -> Response:
        key = await self.authenticate(request)
        if key is None:
            return openai_error(
                401, "Incorrect or missing API key.", "invalid_request_error", "invalid_api_key"
            )
        data = [
            {"id": name, "object": "model", "created": route.created, "owned_by": "fleetserve"}
            for name, route in sorted(self.table.routes.items())
            if (route.endpoints or route.scales_from_zero) and key.allows(name)
        ]
        return JSONResponse({"object": "list", "data": data})


def build_gateway_router(gateway: Gateway) -> APIRouter:
    """The OpenAI API routes over ``gateway``."""
    api = APIRouter(prefix="/v1", tags=["openai"])

    @api.get("/models", summary="Models this key may use that have a Ready replica (or scale from zero)")
    async def models(request: Request) -> Response:
        return await gateway.models(request)

    @api.post("/chat/completions", summary="OpenAI chat completions (stream: true passes events through)")
    async def chat(request: Request) -> Response:
        return await gateway.handle(request, "/v1/chat/completions")

    @api.post("/completions", summary="OpenAI completions")
    async def completions(request: Request) -> Response:
        return await gateway.handle(request, "/v1/completions")

    @api.post("/embeddings", summary="OpenAI embeddings")
    async def embeddings(request: Request) -> Response:
        return await gateway.handle(request, "/v1/embeddings")

    return api
