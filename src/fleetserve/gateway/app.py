"""The gateway's proxy: API keys, rate limits, admission, endpoint picking, forwarding, streaming.

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
- Its refusals are OpenAI error bodies (``gateway.openai_errors``); what it sends an engine is
  built in ``gateway.upstream``; what a request reserves and how it is counted, in
  ``gateway.accounting``.

This is the data path, served as raw ASGI (``gateway.asgi``, ``rawasgi``) under uvicorn with
uvloop and httptools: the body is parsed once with orjson, upstream requests go over
``httpclient``'s pooled keep-alive connections, streamed events are relayed without being parsed.
Everything a request does not need to compute (routes, key lookups, origins, metric label
children) is computed once.
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import AsyncExitStack

import orjson
from starlette.concurrency import run_in_threadpool

from fleetserve.errors import InternalError
from fleetserve.gateway.accounting import Accounting, Exchange, held_reserved, reservation
from fleetserve.gateway.admission import Admission, AdmissionPolicy, GatewayRejection
from fleetserve.gateway.bodylimits import DEFAULT_GATEWAY_LIMITS, GatewayLimits
from fleetserve.gateway.endpoints import EndpointTable, Route
from fleetserve.gateway.openai_errors import send_error
from fleetserve.gateway.picker import Endpoint, Load, pick, prefix_key_for
from fleetserve.gateway.ratelimit import Limits
from fleetserve.gateway.sse import UsageTap, usage_of_body
from fleetserve.gateway.upstream import UPSTREAM_TIMEOUT, relay_stream, relayed, upstream_request
from fleetserve.gateway.usage import UsageCounter
from fleetserve.gateway.usage_flush import FLUSH_SECONDS, UsageFlusher
from fleetserve.gateway.windows import Held, LocalWindows, Windows
from fleetserve.httpclient import HttpClient, UpstreamError
from fleetserve.metrics.exposition import UNKNOWN_MODEL, FleetMetrics
from fleetserve.rawasgi.answers import answer
from fleetserve.rawasgi.body import Unread, read_body
from fleetserve.rawasgi.disconnect import ClientGone, unless_gone
from fleetserve.rawasgi.headers import bearer, header
from fleetserve.rawasgi.types import Receive, Scope, Send
from fleetserve.store.credentials import ApiKey
from fleetserve.store.protocols import GatewayStore, UsageSink

# Requests larger than the largest route kind's limit are refused with 413 before they are parsed.
BODY_LIMIT = DEFAULT_GATEWAY_LIMITS.read_cap
# How long a request waits for a replica when none is Ready (starting, or scaled to zero).
HOLD_SECONDS = 30.0
# API-key lookups are cached this long, so the database is not hit on every request.
KEY_CACHE_SECONDS = 5.0


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
        limits: GatewayLimits = DEFAULT_GATEWAY_LIMITS,
    ) -> None:
        self.store = store
        # What a client's body may hold, and how large an engine answer is held (``bodylimits``).
        self.limits = limits
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
        self.accounting = Accounting(self.usage, metrics, self.admission, self.table)
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
        token = bearer(authorization)
        if token is None:
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
        key = await self.authenticate(header(scope, b"authorization"))
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
        await answer(send, 200, orjson.dumps({"object": "list", "data": data}))

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
        too_large = f"Request body larger than {self.limits.read_cap} bytes."
        if declared is not None and declared.isdigit() and int(declared) > self.limits.read_cap:
            await send_error(send, 413, too_large, "invalid_request_error")
            return
        body = await read_body(receive, self.limits.read_cap)
        if isinstance(body, Unread):
            if body is Unread.OVER_LIMIT:
                await send_error(send, 413, too_large, "invalid_request_error")
            return  # or the client went away: nobody to answer
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:  # invalid, or nested deeper than orjson's 1024 levels
            await send_error(send, 400, "The request body is not valid JSON.", "invalid_request_error")
            return
        # Size, nesting and keys, before any engine parses it (``bodylimits``).
        refused = self.limits.check(data, len(body), path)
        if refused is not None:
            await send_error(send, refused.status, refused.message, "invalid_request_error", refused.code)
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
            self.accounting.account(key, UNKNOWN_MODEL, None, 404, started, None)
            return
        held: Held | None = None
        if key.rpm is not None or key.tpm is not None:
            reserve = (
                reservation(data, body, route.engine_kinds, route.context, path) if key.tpm is not None else 0
            )
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
                self.accounting.account(key, model, model, 429, started, None)
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
        exchange = Exchange()
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
            status = await unless_gone(receive, self._forward(send, model, path, body, prefix, exchange))
        except ClientGone:
            status = 499
        finally:
            await exits.aclose()
            self.last_request[model] = time.monotonic()  # a request is activity until it is answered
            if held is not None:
                used = exchange.usage_total
                await self.windows.settle(held, held_reserved(held) if used is None else used)
            self.accounting.account(key, model, model, status, started, exchange)

    async def _forward(
        self, send: Send, model: str, path: bytes, body: bytes, prefix: str | None, ex: Exchange
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
                        content = await response.read(self.limits.answer_bytes)
                    except UpstreamError as exc:  # failed mid-body: nothing reached the client yet
                        last_error = f"replica {endpoint.replica}: {exc}"
                        continue
                    finally:
                        response.close()
                    usage = usage_of_body(content)
                    if usage is not None:
                        ex.usage_total, ex.prompt, ex.completion = usage.total, usage.prompt, usage.completion
                    await answer(send, response.status, content, relayed(response))
                    return response.status
                await relay_stream(send, response, ex, ex.tap)
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
