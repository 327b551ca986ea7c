"""The OpenAI-compatible gateway: API keys, rate limits, admission, endpoint picking, streaming.

- ``GET /v1/models``; ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``.
- API keys are Bearer tokens, stored hashed, each with its models and request/token limits;
  lookups are cached for ``KEY_CACHE_SECONDS``. A key that may not use a model gets the same 404
  as a model that does not exist.
- The engine ignores the request's ``"model"``: the gateway checks it.
- A request that fails before its first byte reached the client is retried once on another
  replica; after that, never. ``stream: true`` passes the engine's events through as they come;
  a client that disconnects closes the upstream request, which cancels it.
- Tokens count against a key's limit whether or not the client asked for them: the gateway asks
  the engine for the usage event and strips it when the client did not (``sse.UsageTap``).
- Every answered request is counted per minute, key and model in memory (``gateway.usage``) and
  written to the store every few seconds and at stop (``gateway.usage_flush``), never per request.

This is the data path, served as raw ASGI (``gateway.asgi``) under uvicorn with uvloop and
httptools: the body is parsed once with orjson, upstream requests go over ``httpclient``'s pooled
keep-alive connections, streamed events are relayed without being parsed. Everything a request
does not need to compute (routes, key lookups, origins, metric label children) is computed once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import AsyncExitStack
from typing import Any

import orjson
from starlette.concurrency import run_in_threadpool

from fleetserve.errors import FleetserveError, InternalError
from fleetserve.gateway.admission import Admission, AdmissionPolicy, GatewayRejection
from fleetserve.gateway.endpoints import EndpointTable, Route
from fleetserve.gateway.picker import Endpoint, Load, pick, prefix_key_for
from fleetserve.gateway.ratelimit import Limits
from fleetserve.gateway.sse import UsageTap, usage_of_body
from fleetserve.gateway.usage import UsageCounter
from fleetserve.gateway.usage_flush import FLUSH_SECONDS, UsageFlusher
from fleetserve.gateway.windows import Held, LocalWindows, Windows
from fleetserve.httpclient import HttpClient, Origin, Response, UpstreamError
from fleetserve.metrics.exposition import UNKNOWN_MODEL, FleetMetrics
from fleetserve.routing import engine_auth
from fleetserve.store.credentials import ApiKey
from fleetserve.store.protocols import GatewayStore, UsageSink

log = logging.getLogger("fleetserve.gateway")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Requests larger than this are refused with 413 before they are parsed.
BODY_LIMIT = 8 << 20
# How long a request waits for a replica when none is Ready (starting, or scaled to zero).
HOLD_SECONDS = 30.0
# API-key lookups are cached this long, so the database is not hit on every request.
KEY_CACHE_SECONDS = 5.0
# How long an engine may take to start answering (the head of its answer).
UPSTREAM_TIMEOUT = 600.0
# Tokens reserved for a request without max_tokens, until its real usage is known.
DEFAULT_RESERVE_TOKENS = 256
# Bytes of request body per prompt token, for the reservation's estimate of the prompt.
BYTES_PER_TOKEN = 4
# Upstream headers not relayed: hop-by-hop ones, and those uvicorn sets itself (no duplicates).
HOP_HEADERS = frozenset(
    {
        b"content-length",
        b"transfer-encoding",
        b"connection",
        b"keep-alive",
        b"content-encoding",
        b"date",
        b"server",
    }
)
_JSON = (b"content-type", b"application/json")


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> bytes:
    """An error in OpenAI's JSON shape."""
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


async def send_body(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """Answer with a whole body (JSON unless ``headers`` say otherwise)."""
    head = headers if headers is not None else [_JSON]
    head.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


async def send_error(
    send: Send,
    status: int,
    message: str,
    kind: str,
    code: str | None = None,
    param: str | None = None,
    retry_after: int | None = None,
) -> None:
    """Answer with an error in OpenAI's shape (and ``Retry-After`` when given)."""
    headers = [_JSON]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send_body(send, status, error_body(message, kind, code, param), headers)


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
    return b"\n\ndata: " + orjson.dumps(body) + b"\n\n"


@functools.lru_cache(maxsize=4096)
def origin_of(url: str) -> tuple[Origin, bytes]:
    """An endpoint URL's origin and its Host header value (cached: URLs repeat)."""
    scheme, _, authority = url.partition("://")
    host, _, port = authority.rpartition(":")
    return Origin(host.strip("[]"), int(port), scheme == "https"), authority.encode()


@functools.lru_cache(maxsize=4096)
def _auth_line(engine_key: str | None) -> bytes:
    """The replica's engine key as a header line (none for a replica placed before engine keys)."""
    if engine_key is not None and ("\r" in engine_key or "\n" in engine_key):
        raise UpstreamError("the replica's engine key holds a line break: not sent")
    return b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in engine_auth(engine_key).items())


def upstream_request(endpoint: Endpoint, path: bytes, body: bytes) -> tuple[Origin, bytes]:
    """The request to send to an engine, head and body: the one place its headers are built."""
    origin, host = origin_of(endpoint.url)
    # The replica's own engine key: the engine refuses any request without it.
    head = (
        b"POST %s HTTP/1.1\r\nHost: %s\r\n%sContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % (
            path,
            host,
            _auth_line(endpoint.engine_key),
            len(body),
        )
    )
    return origin, head + body


def reservation(data: dict[str, Any], body: bytes) -> int:
    """Tokens to reserve for a request before its usage is known: its completion budget and prompt."""
    budget = data.get("max_tokens")
    if not isinstance(budget, int) or budget < 0:
        budget = data.get("max_completion_tokens")
    if not isinstance(budget, int) or budget < 0:
        budget = DEFAULT_RESERVE_TOKENS
    return budget + len(body) // BYTES_PER_TOKEN


class ClientGone(FleetserveError):
    """The client disconnected before its answer was ready; the upstream request was cancelled."""


class _Exchange:
    """One request's bookkeeping across its tries: what was sent where, when, and what came back."""

    __slots__ = (
        "broken", "completion", "endpoint", "first_at", "last_at", "prompt", "sent_at", "tap", "usage_total",
    )  # fmt: skip

    def __init__(self) -> None:
        self.endpoint: Endpoint | None = None
        self.sent_at = 0.0
        self.first_at: float | None = None
        self.last_at = 0.0
        self.tap: UsageTap | None = None
        self.usage_total: int | None = None
        self.prompt = 0
        self.completion = 0
        self.broken = False  # a stream whose upstream broke off after its first byte


class Gateway:
    """The gateway's state: routes, admission, rate-limit windows, in-flight counts, upstream client."""

    def __init__(
        self,
        store: GatewayStore,
        refresh_seconds: float = 1.0,
        seed: int | None = None,
        metrics: FleetMetrics | None = None,
        engine_waiting: Callable[[str], tuple[float, float] | None] | None = None,
        windows: Windows | None = None,
        usage: UsageSink | None = None,
        usage_flush_seconds: float = FLUSH_SECONDS,
    ) -> None:
        self.store = store
        # Usage per minute, key and model, written to ``usage`` every ``usage_flush_seconds``
        # (none counted without a sink).
        self.usage: UsageCounter | None = UsageCounter() if usage is not None else None
        self.usage_flusher = (
            UsageFlusher(self.usage, usage, usage_flush_seconds)
            if self.usage is not None and usage is not None
            else None
        )
        self.metrics = metrics
        # replica → (engine-reported waiting requests, age of that figure in seconds), if known
        self.engine_waiting = engine_waiting
        self.last_request: dict[str, float] = {}
        self.admission = Admission()
        self.table = EndpointTable(store, refresh_seconds=refresh_seconds, on_change=self.admission.notify)
        self.windows: Windows = windows if windows is not None else LocalWindows()
        self.rng = random.Random(seed)
        self.in_flight: dict[str, int] = defaultdict(int)
        self._keys: dict[bytes, tuple[ApiKey | None, float]] = {}
        self._queue_depth: dict[str, int] = {}
        self._policies: dict[str, tuple[Route, AdmissionPolicy]] = {}
        self.http: HttpClient | None = None

    async def start(self) -> None:
        """Open the upstream client and start following the replicas."""
        self.http = HttpClient()
        await self.table.refresh()
        self.table.start()
        if self.usage_flusher is not None:
            self.usage_flusher.start()

    async def stop(self) -> None:
        """Stop following replicas; write the usage counted last; close the upstream client and
        the windows."""
        await self.table.stop()
        if self.usage_flusher is not None:
            await self.usage_flusher.stop()
        if self.http is not None:
            await self.http.aclose()
        await self.windows.aclose()

    # --- checks -----------------------------------------------------------------------------------

    async def authenticate(self, authorization: bytes | None) -> ApiKey | None:
        """The key an ``Authorization: Bearer`` header value names, or None (cached a few seconds)."""
        if not authorization:
            return None
        now = time.monotonic()
        cached = self._keys.get(authorization)
        if cached is not None and cached[1] > now:
            return cached[0]
        scheme, _, token = authorization.decode("latin-1").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        key = await run_in_threadpool(self.store.verify_api_key, token)
        if len(self._keys) > 10_000:
            self._keys.clear()
        self._keys[authorization] = (key, now + KEY_CACHE_SECONDS)
        return key

    def forget_keys(self) -> None:
        """Drop cached API-key lookups (after a revocation): the next request checks the store."""
        self._keys.clear()

    def route_of(self, model: str) -> Route | None:
        return self.table.routes.get(model)

    def _policy(self, route: Route) -> AdmissionPolicy:
        """The route's admission policy, built once per route (routes are replaced on change)."""
        cached = self._policies.get(route.deployment)
        if cached is not None and cached[0] is route:
            return cached[1]
        policy = AdmissionPolicy.of(route.policy, max_concurrency_per_replica=route.concurrency_per_replica)
        self._policies[route.deployment] = (route, policy)
        return policy

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
        exclude = exclude | self.table.ejected(model)  # outlier ejection: connect failures, backoff
        return pick(route.endpoints, loads, self.rng, exclude=exclude, prefix_key=prefix)

    # --- GET /v1/models ---------------------------------------------------------------------------

    async def models(self, scope: Scope, send: Send) -> None:
        key = await self.authenticate(_header(scope, b"authorization"))
        if key is None:
            await send_error(
                send, 401, "Incorrect or missing API key.", "invalid_request_error", "invalid_api_key"
            )
            return
        data = [
            {"id": name, "object": "model", "created": route.created, "owned_by": "fleetserve"}
            for name, route in sorted(self.table.routes.items())
            if (route.endpoints or route.scales_from_zero) and key.allows(name)
        ]
        await send_body(send, 200, orjson.dumps({"object": "list", "data": data}))

    # --- POST /v1/... ------------------------------------------------------------------------------

    async def proxy(self, scope: Scope, receive: Receive, send: Send, path: bytes) -> None:
        """Check, admit and forward one request to a replica; relay its answer."""
        started = time.monotonic()
        authorization = declared = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == b"content-length":
                declared = value
        key = await self.authenticate(authorization)
        if key is None:
            await send_error(
                send,
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                "invalid_request_error",
                "invalid_api_key",
            )
            return
        too_large = f"Request body larger than {BODY_LIMIT} bytes."
        if declared is not None and declared.isdigit() and int(declared) > BODY_LIMIT:
            await send_error(send, 413, too_large, "invalid_request_error")
            return
        body = await _read_body(receive)
        if body is None:
            await send_error(send, 413, too_large, "invalid_request_error")
            return
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:  # invalid, or nested deeper than orjson's 1024 levels
            await send_error(send, 400, "The request body is not valid JSON.", "invalid_request_error")
            return
        model = data.get("model") if isinstance(data, dict) else None
        if not isinstance(model, str) or not model:
            await send_error(
                send, 400, "You must provide a model parameter.", "invalid_request_error", param="model"
            )
            return
        # A key's own models only: another key's miss must not cost the store a read.
        route = await self.table.lookup(model) if key.allows(model) else None
        if route is None:
            # The same answer either way: a key must not learn which models exist beyond its own.
            await send_error(
                send,
                404,
                f"The model `{model}` does not exist or you do not have access to it.",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
            self._account(key, UNKNOWN_MODEL, None, 404, started, None)
            return
        held: Held | None = None
        if key.rpm is not None or key.tpm is not None:
            reserve = reservation(data, body) if key.tpm is not None else 0
            decision, held = await self.windows.admit(str(key.id), Limits(key.rpm, key.tpm), reserve)
            if not decision.allowed:
                if self.metrics is not None:
                    self.metrics.gateway_rejection(model, "RateLimited")
                which = decision.which.value if decision.which else "requests"
                await send_error(
                    send,
                    429,
                    f"Rate limit reached for {which} per minute on this API key; retry after "
                    f"{decision.retry_after_header} s.",
                    which,
                    "rate_limit_exceeded",
                    retry_after=decision.retry_after_header,
                )
                self._account(key, model, model, 429, started, None)
                return
        # Past the checks: from here the request is demand (activity for scale-to-zero).
        self.last_request[model] = time.monotonic()
        stream = data.get("stream") is True
        strip = False
        if stream:
            options = data.get("stream_options")
            if not (isinstance(options, dict) and options.get("include_usage") is True):
                # Ask the engine for the usage event, so the stream's tokens are counted; the
                # client, which did not ask for it, does not get it.
                data["stream_options"] = {
                    **(options if isinstance(options, dict) else {}),
                    "include_usage": True,
                }
                body = orjson.dumps(data)
                strip = True
        prefix = None
        if route.prefix_affinity:
            prefix = prefix_key_for(data.get("messages") or data.get("prompt") or data.get("input") or "")
        exchange = _Exchange()
        status = 500
        exits = AsyncExitStack()
        try:
            try:
                await exits.enter_async_context(
                    self.admission.slot(model, self._policy(route), lambda: self._ready(model), HOLD_SECONDS)
                )
            except GatewayRejection as exc:
                exchange.usage_total = 0  # nothing was generated
                if self.metrics is not None:
                    self.metrics.gateway_rejection(model, type(exc).__name__)
                kind = "overloaded" if exc.status == 429 else "service_unavailable"
                status = exc.status
                await send_error(
                    send, status, str(exc), kind, kind, retry_after=max(1, math.ceil(exc.retry_after))
                )
                return
            if stream:
                exchange.tap = UsageTap(strip)
            status = await self._unless_gone(
                receive, self._forward(send, model, path, body, prefix, exchange)
            )
        except ClientGone:
            status = 499
        finally:
            await exits.aclose()
            self.last_request[model] = time.monotonic()  # a request is activity until it is answered
            if held is not None:
                used = exchange.usage_total
                await self.windows.settle(held, held_reserved(held) if used is None else used)
            self._account(key, model, model, status, started, exchange)

    def _account(
        self,
        key: ApiKey,
        model: str,
        deployment: str | None,
        status: int,
        started: float,
        ex: _Exchange | None,
    ) -> None:
        usage = self.usage
        if usage is not None:  # one dict update; written to the store by the flusher
            usage.add(
                time.time(), key.id, model, ex.prompt if ex else 0, ex.completion if ex else 0,
                status >= 400 or (ex is not None and ex.broken),
            )  # fmt: skip
        metrics = self.metrics
        if metrics is None:
            return
        seconds = time.monotonic() - started
        if deployment is not None:
            metrics.gateway_answer(deployment, status, seconds)
            waiting = self.admission.depth(deployment).waiting
            if self._queue_depth.get(deployment) != waiting:  # a gauge: set only when it moved
                self._queue_depth[deployment] = waiting
                metrics.set_queue_depth(deployment, waiting)
        metrics.gateway_key_request(
            key.name, model, seconds, ex.prompt if ex else 0, ex.completion if ex else 0
        )
        if ex is not None and ex.first_at is not None and ex.endpoint is not None and deployment is not None:
            tap = ex.tap
            itl = None
            if tap is not None and tap.events > 2 and ex.last_at > ex.first_at:
                itl = (ex.last_at - ex.first_at) / (tap.events - 2)  # minus [DONE] and the first
            route = self.table.routes.get(deployment)
            engine = route.engines.get(ex.endpoint.replica, "") if route is not None else ""
            metrics.gateway_stream(deployment, ex.endpoint.replica, engine, ex.first_at - ex.sent_at, itl)

    async def _unless_gone(self, receive: Receive, work: Awaitable[int]) -> int:
        """Await ``work``; if the client disconnects first, cancel it (and with it the upstream)."""
        task = asyncio.current_task()
        if task is None:
            raise InternalError("the gateway runs requests in tasks")
        watch = asyncio.ensure_future(receive())  # after the body, receive() waits for a disconnect
        finished = False

        def gone(done: asyncio.Future[Message]) -> None:
            if (
                not finished
                and not done.cancelled()
                and done.exception() is None
                and done.result().get("type") == "http.disconnect"
            ):
                task.cancel()

        watch.add_done_callback(gone)
        try:
            return await work
        except asyncio.CancelledError:
            if watch.done() and not finished:
                task.uncancel()
                raise ClientGone() from None
            raise
        finally:
            finished = True
            if not watch.done():
                watch.cancel()

    async def _forward(
        self, send: Send, model: str, path: bytes, body: bytes, prefix: str | None, ex: _Exchange
    ) -> int:
        """Send to a replica (once more to another if it fails before any byte reached the client)."""
        http = self.http
        if http is None:
            raise InternalError("the gateway forwards requests only between start() and stop()")
        tried: set[str] = set()
        last_error = "no replica is ready"
        for _ in range(2):
            endpoint = self._pick(model, frozenset(tried), prefix)
            if endpoint is None:
                break
            tried.add(endpoint.replica)
            self.in_flight[endpoint.replica] += 1
            try:
                ex.endpoint = endpoint
                ex.sent_at = time.monotonic()
                try:
                    origin, request = upstream_request(endpoint, path, body)
                    response = await http.request(origin, request, UPSTREAM_TIMEOUT)
                except UpstreamError as exc:
                    self.table.failed(endpoint.replica, exc)  # a connect failure ejects it at once
                    last_error = f"replica {endpoint.replica}: {exc}"
                    continue
                if response.status >= 500:
                    response.close()
                    last_error = f"replica {endpoint.replica} answered {response.status}"
                    continue
                if ex.tap is None:
                    try:
                        content = await response.read()
                    except UpstreamError as exc:  # failed mid-body: nothing reached the client yet
                        last_error = f"replica {endpoint.replica}: {exc}"
                        continue
                    finally:
                        response.close()
                    usage = usage_of_body(content)
                    if usage is not None:
                        ex.usage_total, ex.prompt, ex.completion = usage.total, usage.prompt, usage.completion
                    await send_body(send, response.status, content, _relayed(response))
                    return response.status
                await self._relay(send, response, ex, ex.tap)
                return response.status
            finally:
                self.in_flight[endpoint.replica] -= 1
        ex.usage_total = 0  # nothing was generated
        await send_error(
            send,
            503,
            f"No replica of `{model}` could serve the request ({last_error}).",
            "service_unavailable",
            "no_replica",
            retry_after=1,
        )
        return 503

    async def _relay(self, send: Send, response: Response, ex: _Exchange, tap: UsageTap) -> None:
        """Pass the engine's events through as they come; a broken upstream is told, not hidden."""
        await send({"type": "http.response.start", "status": response.status, "headers": _relayed(response)})
        try:
            while True:
                piece = await response.next_piece()
                if not piece:
                    break
                now = time.monotonic()
                if ex.first_at is None:
                    ex.first_at = now
                ex.last_at = now
                out = tap.feed(piece)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
            await send({"type": "http.response.body", "body": tap.flush(), "more_body": False})
        except UpstreamError as exc:
            # Never end a broken stream as if it were complete: the client gets an error event
            # (OpenAI clients raise on it) and no [DONE].
            replica = ex.endpoint.replica if ex.endpoint else "?"
            ex.broken = True
            log.warning("stream from %s broke off: %s", replica, exc)
            await send(
                {"type": "http.response.body", "body": broken_stream_event(replica), "more_body": False}
            )
        finally:
            response.close()
            if tap.usage is not None:
                ex.usage_total, ex.prompt, ex.completion = (
                    tap.usage.total,
                    tap.usage.prompt,
                    tap.usage.completion,
                )


def held_reserved(held: Held) -> int:
    """The tokens a reservation holds (settled as used when the answer had no usage)."""
    return held.reserved


def _relayed(response: Response) -> list[tuple[bytes, bytes]]:
    return [(n, v) for n, v in response.headers if n.lower() not in HOP_HEADERS]


def _header(scope: Scope, wanted: bytes) -> bytes | None:
    for name, value in scope["headers"]:
        if name == wanted:
            return bytes(value)
    return None


async def _read_body(receive: Receive) -> bytes | None:
    """The request body, or None once it grows past ``BODY_LIMIT``."""
    message = await receive()
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        return body
    parts = [body]
    size = len(body)
    while message.get("more_body", False):
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > BODY_LIMIT:
            return None
        parts.append(chunk)
    return b"".join(parts)
