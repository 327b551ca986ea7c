"""The gateway's proxy: API keys, rate limits, admission, endpoint picking, forwarding, streaming.

- Every client route of the engines' route tables (``EngineSpec.routes``), dispatched by
  ``gateway.asgi``; ``GET /v1/models`` (and ``/models``) answered here, merged with what each
  engine says (``gateway.modelinfo``). A request names its model in its body's ``"model"``; where
  its route allows (llama.cpp's own routes, GETs), by ``?model=``, else the key's one model.
- API keys are Bearer tokens (or ``X-Api-Key``, as Anthropic's clients send them), stored
  hashed, each with its models and request/token limits; lookups are cached for
  ``KEY_CACHE_SECONDS``. A key that may not use a model gets the same 404
  as a model that does not exist.
- The engine ignores the request's ``"model"``: the gateway checks it.
- What the engine answers, the client gets: its status and body, an error's in OpenAI's shape where
  the engine's is not. Only a try that got no answer at all (no connection; closed, or no status
  line, in time; bytes its host never acknowledged) is retried, once, on another replica, its
  connection reset first; 503 ``no_replica`` only when none could be reached. ``stream: true``
  passes the engine's events through as they come; a client that disconnects closes the upstream
  request, which cancels it.
- Tokens count against a key's limit whether or not the client asked for them: the gateway asks
  the engine for usage when the client did not, and takes out only what its ask added
  (``sse.UsageTap``); a request is settled at what every sequence used (``accounting.settlement``).
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

import logging
import math
import random
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from typing import Any
from urllib.parse import parse_qs

import orjson
from starlette.concurrency import run_in_threadpool

from fleetserve.cachereport import CacheReport
from fleetserve.endpointkeys import EndpointKeys
from fleetserve.engines.routes import ApiRoute, ModelBy, RouteKind, UsageBy, task_refusal
from fleetserve.engines.spec import EngineKind
from fleetserve.errors import InternalError
from fleetserve.gateway.accounting import (
    Accounting,
    Exchange,
    answering_fields,
    held_reserved,
    reservation,
    settlement,
)
from fleetserve.gateway.admission import Admission, AdmissionPolicy, GatewayRejection
from fleetserve.gateway.bodylimits import DEFAULT_GATEWAY_LIMITS, GatewayLimits
from fleetserve.gateway.endpoints import EndpointTable, Route
from fleetserve.gateway.modelinfo import ModelInfo, merged
from fleetserve.gateway.openai_errors import send_error
from fleetserve.gateway.picker import (
    Endpoint,
    Load,
    pick,
    pick_cache_aware,
    pick_round_robin,
    prefix_key_for,
)
from fleetserve.gateway.prefixcache import (
    BLOCK_BYTES,
    BYTES_PER_TOKEN,
    PrefixCaches,
    block_keys,
    prompt_bytes,
)
from fleetserve.gateway.ratelimit import Limits
from fleetserve.gateway.sse import UsageTap
from fleetserve.gateway.upstream import (
    BEFORE_ANY_ANSWER,
    UPSTREAM_TIMEOUT,
    Call,
    answer_failed,
    relay_answer,
    relay_stream,
    upstream_request,
)
from fleetserve.gateway.usage import UsageCounter
from fleetserve.gateway.usage_flush import FLUSH_SECONDS, UsageFlusher
from fleetserve.gateway.windows import Held, LocalWindows, Windows
from fleetserve.httpclient import ConnectFailed, HttpClient, NoAnswer, UpstreamError
from fleetserve.metrics.exposition import UNKNOWN_MODEL, FleetMetrics
from fleetserve.rawasgi.answers import answer
from fleetserve.rawasgi.body import Unread, read_body
from fleetserve.rawasgi.disconnect import ClientGone, unless_gone
from fleetserve.rawasgi.headers import bearer
from fleetserve.rawasgi.types import Receive, Scope, Send
from fleetserve.store.credentials import ApiKey
from fleetserve.store.protocols import GatewayStore, UsageSink

log = logging.getLogger("fleetserve.gateway")

# Routes that only look (an engine's health, its settings): not demand, no admission slot.
PROBES = frozenset({RouteKind.HEALTH, RouteKind.METADATA})

EngineRoutes = Mapping[EngineKind, ApiRoute]
"""What one method and path is for each engine that serves it (``gateway.asgi.ApiIndex``)."""

# Requests larger than the largest route kind's limit are refused with 413 before they are parsed.
BODY_LIMIT = DEFAULT_GATEWAY_LIMITS.read_cap
# How long a request waits for a replica when none is Ready (starting, or scaled to zero).
HOLD_SECONDS = 30.0
# API-key lookups are cached this long, so the database is not hit on every request.
KEY_CACHE_SECONDS = 5.0


def credential(scope: Scope) -> bytes | None:
    """The request's API key as an ``Authorization`` value: that header, else ``X-Api-Key``'s key
    (Anthropic's clients) as ``Bearer KEY``."""
    x_api_key = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            return bytes(value)
        if name == b"x-api-key" and x_api_key is None:
            x_api_key = b"Bearer " + value
    return x_api_key


def _unserved(routes: EngineRoutes, route: Route, method: str, path: str) -> tuple[int, str, str] | None:
    """Why ``route``'s deployment does not serve ``method path`` to an API key (status, message,
    code): an engine it runs has no such route, or does not relay it to keys; None when it serves it."""
    for engine in sorted(route.engine_kinds):
        row = routes.get(engine)
        if row is None:
            return (
                404,
                f"{method} {path} is not served by {engine.value}, which `{route.deployment}` runs.",
                "route_not_served",
            )
        if not row.keys:
            status = 403 if row.kind is RouteKind.ADMIN else 404
            return status, f"{method} {path} is not relayed to API keys: {row.why}.", "route_not_relayed"
    return None


class Gateway:
    """The gateway's state: routes, admission, rate-limit windows, in-flight counts, upstream client."""

    def __init__(
        self,
        store: GatewayStore,
        refresh_seconds: float = 1.0,
        seed: int | None = None,
        metrics: FleetMetrics | None = None,
        engine_waiting: Callable[[str], tuple[float, float] | None] | None = None,
        engine_cache: Callable[[str], tuple[int, float | None]] | None = None,
        engine_report: Callable[[str], CacheReport | None] | None = None,
        windows: Windows | None = None,
        usage: UsageSink | None = None,
        usage_flush_seconds: float = FLUSH_SECONDS,
        limits: GatewayLimits = DEFAULT_GATEWAY_LIMITS,
        endpoint_keys: EndpointKeys | None = None,
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
        # replica → (its engine's epoch, its KV usage 0-1 or None): an epoch that moved clears
        # the replica's cache model (``gateway.prefixcache``)
        self.engine_cache = engine_cache
        # replica → what its engine last said it holds (``cachereport``): corrects its cache model
        self.engine_report = engine_report
        # What this gateway believes each replica caches, from what it routed (no other's).
        self.caches = PrefixCaches()
        # Per deployment, the next round-robin turn.
        self.turns: dict[str, int] = defaultdict(int)
        # Whether replicas left the routes since the cache models were last pruned.
        self._prune = False
        self.last_request: dict[str, float] = {}
        self.admission = Admission()
        # Where the Endpoints' API keys are read (``endpointkeys``): never from the store.
        self.table = EndpointTable(
            store,
            refresh_seconds=refresh_seconds,
            on_change=self._changed,
            keys=endpoint_keys or EndpointKeys(),
        )
        self.windows: Windows = windows if windows is not None else LocalWindows()
        self.rng = random.Random(seed)
        self.in_flight: dict[str, int] = defaultdict(int)
        self._keys: dict[bytes, tuple[ApiKey | None, float]] = {}
        self.accounting = Accounting(self.usage, metrics, self.admission, self.table)
        self._policies: dict[str, tuple[Route, AdmissionPolicy]] = {}
        self.http: HttpClient | None = None
        # What each replica's engine says about its model, for /v1/models.
        self.model_info = ModelInfo()
        # How long a replica may take to start answering (its status line) before the try is
        # given up as unanswered.
        self.upstream_timeout = UPSTREAM_TIMEOUT

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
        """The key an ``Authorization: Bearer`` header value names, or None (cached a few seconds).
        A key sent as ``X-Api-Key`` (Anthropic's clients) comes here as ``Bearer KEY``
        (``credential``)."""
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

    def _unnamed_model(self, key: ApiKey, routes: EngineRoutes, query: bytes) -> str | None:
        """The model of a request whose body names none, where its route lets it be named
        otherwise: ``?model=``, else the key's one model (the one it may use, or the one served of
        those it may); None when the route needs the body's, or when that leaves a choice."""
        if all(r.model_by is ModelBy.BODY for r in routes.values()):
            return None
        if query:
            named = parse_qs(query.decode("latin-1")).get("model")
            if named and named[0]:
                return named[0]
        own = [m for m in key.models if m != "*"]
        if len(own) == 1 and "*" not in key.models:
            return own[0]
        served = [
            n for n, r in self.table.routes.items() if (r.endpoints or r.scales_from_zero) and key.allows(n)
        ]
        return served[0] if len(served) == 1 else None

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

    def _changed(self, deployment: str) -> None:
        """A deployment's endpoints changed: wake its waiters; forget replicas no longer routed."""
        self.admission.notify(deployment)
        self._prune = True  # once, at the next cache-aware pick, however many changed at once

    def _ready(self, model: str) -> int:
        route = self.table.routes.get(model)
        return len(route.endpoints) if route else 0

    def _load(self, replica: str) -> Load:
        """Outstanding work on a replica: the gateway's in-flight count plus the engine's fresh queue."""
        waiting = self.engine_waiting(replica) if self.engine_waiting is not None else None
        if waiting is None:
            return Load(self.in_flight[replica])
        kv = self.engine_cache(replica)[1] if self.engine_cache is not None else None
        return Load(self.in_flight[replica], int(waiting[0]), waiting[1], kv)

    def _pick(
        self, model: str, exclude: frozenset[str], steer: Steer, ex: Exchange | None = None
    ) -> Endpoint | None:
        """The replica for the next try of a request, by its route's policy; the cache-aware pick
        learns the prompt's blocks for the replica chosen. With ``ex.pick_header`` asked for (not
        None), the pick's reason goes there: its own replica and deployment only."""
        route = self.table.routes.get(model)
        if route is None:
            return None
        exclude = exclude | self.table.ejected(model)  # outlier ejection: connect failures, backoff
        policy = route.routing
        if policy == "round-robin":
            turn = self.turns[model]
            self.turns[model] = turn + 1
            chosen = pick_round_robin(route.endpoints, turn, exclude=exclude)
            if chosen is not None and ex is not None and ex.pick_header is not None:
                ex.pick_header = _reason(chosen.replica, policy, self.in_flight[chosen.replica])
            return chosen
        loads = {e.replica: self._load(e.replica) for e in route.endpoints}
        keys = steer.keys
        if policy == "cache-aware" and keys is not None:
            caches = self.caches
            if self._prune:
                self._prune = False
                caches.keep_only(e.replica for r in self.table.routes.values() for e in r.endpoints)
            cached: dict[str, int] = {}
            report = self.engine_report
            for e in route.endpoints:
                epoch = self.engine_cache(e.replica)[0] if self.engine_cache is not None else None
                cache = caches.sync(e.replica, e.kv_tokens, epoch, e.kv_prompts)
                if report is not None:
                    caches.correct(e.replica, report(e.replica))
                cached[e.replica] = cache.matched(keys) * _BLOCK_TOKENS
            chosen_pick = pick_cache_aware(
                route.endpoints, loads, cached, steer.tokens, self.rng, exclude=exclude
            )
            if chosen_pick is None:
                return None
            caches.learn(chosen_pick.endpoint.replica, keys)
            if self.metrics is not None:
                self.metrics.gateway_cache_pick(model, steer.tokens, chosen_pick.cached_tokens)
            if ex is not None and ex.pick_header is not None:
                ex.pick_header = _reason(
                    chosen_pick.endpoint.replica,
                    policy,
                    chosen_pick.outstanding,
                    cached=chosen_pick.cached_tokens,
                    prompt=steer.tokens,
                )
            return chosen_pick.endpoint
        prefix = steer.prefix if policy == "prefix-hash" else None
        chosen = pick(route.endpoints, loads, self.rng, exclude=exclude, prefix_key=prefix)
        if chosen is not None and ex is not None and ex.pick_header is not None:
            shown = policy if policy != "cache-aware" else "least-load"  # one replica, or no prompt
            ex.pick_header = _reason(chosen.replica, shown, loads[chosen.replica].outstanding())
        return chosen

    # --- GET /v1/models ---------------------------------------------------------------------------

    async def models(self, scope: Scope, send: Send) -> None:
        """The models the key may use, each with what its engine says (``gateway.modelinfo``)."""
        key = await self.authenticate(credential(scope))
        if key is None:
            await send_error(
                send, 401, "Incorrect or missing API key.", "authentication_error", "invalid_api_key"
            )
            return
        listed = [
            (name, route)
            for name, route in sorted(self.table.routes.items())
            if (route.endpoints or route.scales_from_zero) and key.allows(name)
        ]
        info = self.model_info
        info.keep_only(e for route in self.table.routes.values() for e in route.endpoints)
        if self.http is not None:
            asked = (info.to_ask(route.endpoints) for _, route in listed)
            await info.ask(self.http, [e for e in asked if e is not None])
        data = [
            merged(name, route.created, info.of(route.endpoints), route.task, route.base)
            for name, route in listed
        ]
        await answer(send, 200, orjson.dumps({"object": "list", "data": data}))

    # --- POST /v1/... ------------------------------------------------------------------------------

    async def proxy(self, scope: Scope, receive: Receive, send: Send, routes: EngineRoutes) -> None:
        """Check, admit and forward one request to a replica; relay its answer. ``routes``: what
        the request's method and path are for each engine that serves them (``gateway.asgi``)."""
        started = time.monotonic()
        authorization = declared = None
        debug_pick = False
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == b"content-length":
                declared = value
            elif name == b"x-api-key" and authorization is None:
                authorization = b"Bearer " + value  # Anthropic clients send their key so
            elif name == b"x-fleetserve-debug" and b"pick" in value.lower():
                debug_pick = True
        if authorization is None and all(r.kind is RouteKind.HEALTH for r in routes.values()):
            # A probe without credentials (a load balancer's, a client's readiness wait), as
            # llama-server's /health needs no key: the gateway's own readiness, naming no model.
            if any(route.endpoints for route in self.table.routes.values()):
                await answer(send, 200, b'{"status":"ok"}')
            else:
                await send_error(
                    send, 503, "No deployment has a Ready replica.", "service_unavailable", "no_replica"
                )
            return
        key = await self.authenticate(authorization)
        if key is None:
            await send_error(
                send,
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>' or 'X-Api-Key: <key>'.",
                "authentication_error",
                "invalid_api_key",
            )
            return
        method: str = scope["method"]
        lead = next(iter(routes.values()))
        # The path the route was found by (decoded), not the raw one: the engine gets the route that
        # was checked, whatever percent-encoding a client chose.
        path_only = scope["path"].encode("utf-8")
        query: bytes = scope.get("query_string", b"")
        has_body = method != "GET"
        call = Call.of(method, path_only, query, scope["headers"], has_body)
        if call is None:
            await send_error(
                send, 400, "The request's path or query string cannot be relayed.", "invalid_request_error"
            )
            return
        data: dict[str, Any] = {}
        # Whether the body is a JSON object (``data``): an Endpoint's upstream model name goes in it.
        json_object = False
        body = b""
        if has_body:
            cap = self.limits.read_cap
            too_large = f"Request body larger than {cap} bytes."
            if declared is not None and declared.isdigit() and int(declared) > cap:
                await send_error(send, 413, too_large, "invalid_request_error")
                return
            read = await read_body(receive, cap)
            if isinstance(read, Unread):
                if read is Unread.OVER_LIMIT:
                    await send_error(send, 413, too_large, "invalid_request_error")
                return  # or the client went away: nobody to answer
            body = read
            try:
                parsed = orjson.loads(body)
            except orjson.JSONDecodeError:  # invalid, or nested deeper than orjson's 1024 levels
                await send_error(send, 400, "The request body is not valid JSON.", "invalid_request_error")
                return
            # Size, nesting and keys, before any engine parses it (``bodylimits``).
            refused = self.limits.check(parsed, len(body), lead.kind)
            if refused is not None:
                await send_error(send, refused.status, refused.message, "invalid_request_error", refused.code)
                return
            if isinstance(parsed, dict):
                data, json_object = parsed, True
        model = data.get("model")
        if not isinstance(model, str) or not model:
            model = self._unnamed_model(key, routes, query)
            fallback = self.table.default() if model is None else None
            if fallback is not None and key.allows(fallback.deployment):
                model = fallback.deployment
            if model is None:
                await send_error(
                    send,
                    400,
                    "You must provide a model parameter"
                    + ("." if lead.model_by is ModelBy.BODY else " (the body's model, or ?model=)."),
                    "invalid_request_error",
                    param="model",
                )
                return
        # A key's own models only: another key's miss must not cost the store a read.
        route = await self.table.lookup(model) if key.allows(model) else None
        if route is None:
            # A name no deployment serves goes to the fleet's default deployment, if it has one.
            fallback = self.table.default()
            if fallback is not None and key.allows(fallback.deployment):
                route = fallback
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
        model = route.deployment  # a name the default deployment took is counted as that deployment
        unserved = _unserved(routes, route, method, scope["path"])
        if unserved is not None:
            status, message, code = unserved
            await send_error(send, status, message, "invalid_request_error", code)
            self.accounting.account(key, model, model, status, started, None)
            return
        wrong_task = task_refusal(lead.kind, route.task, model, method, scope["path"])
        if wrong_task is not None:
            await send_error(send, 400, wrong_task, "invalid_request_error", "model_task_mismatch", "model")
            self.accounting.account(key, model, model, 400, started, None)
            return
        path = path_only
        counted = any(routes[e].usage is not UsageBy.NONE for e in route.engine_kinds if e in routes)
        held: Held | None = None
        if key.rpm is not None or key.tpm is not None:
            reserve = (
                reservation(data, body, route.engine_kinds, route.context, path, lead.kind)
                if key.tpm is not None and counted
                else 0
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
        # May a try that got no answer go to another replica: every engine's row must say so.
        retry = all(routes[e].retry for e in route.engine_kinds if e in routes)
        probe = all(routes[e].kind in PROBES for e in route.engine_kinds if e in routes)
        if probe:
            # A probe (health, metadata) is not demand: it never wakes a deployment scaled to zero
            # nor waits for a replica to start; with none Ready it is answered at once.
            if not route.endpoints:
                await send_error(
                    send,
                    503,
                    f"No replica of `{model}` is ready.",
                    "service_unavailable",
                    "no_replica",
                    retry_after=1,
                )
                self.accounting.account(key, model, model, 503, started, None)
                return
        else:
            # Past the checks: from here the request is demand (activity for scale-to-zero).
            self.last_request[model] = time.monotonic()
        stream = data.get("stream") is True
        strip = False
        if stream and all(r.usage is UsageBy.STREAM_OPTION for r in routes.values()):
            options = data.get("stream_options")
            if not (isinstance(options, dict) and options.get("include_usage") is True):
                # Ask the engine for usage, so the stream's tokens are counted; the client, which
                # did not ask for it, does not get what the ask added (``UsageTap``).
                data["stream_options"] = {
                    **(options if isinstance(options, dict) else {}),
                    "include_usage": True,
                }
                body = orjson.dumps(data)
                strip = True
        steer = steer_of(route.routing, len(route.endpoints), data)
        exchange = Exchange()
        if debug_pick:
            exchange.pick_header = b""
        exchange.counts = all(routes[e].usage is UsageBy.COUNTS for e in route.engine_kinds if e in routes)
        status = 500
        exits = AsyncExitStack()
        try:
            try:
                if not probe:  # a probe takes no generation slot and waits in no queue
                    await exits.enter_async_context(
                        self.admission.slot(
                            model, self._policy(route), lambda: self._ready(model), HOLD_SECONDS
                        )
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
                exchange.tap = UsageTap(strip, exchange.counts)
            status = await unless_gone(
                receive,
                self._forward(send, model, call, body, steer, exchange, retry, data if json_object else None),
            )
        except ClientGone:
            status = 499
        finally:
            await exits.aclose()
            if not probe:  # a request is activity until it is answered
                self.last_request[model] = time.monotonic()
            # What the request used (counted in ``exchange`` too where the engine reports usage
            # per sequence); a key with limits is settled at it.
            reserved = held_reserved(held) if held is not None else 0
            used = settlement(reserved, exchange, answering_fields(route, exchange), data)
            if held is not None:
                await self.windows.settle(held, used)
            self.accounting.account(key, model, model, status, started, exchange)

    async def _forward(
        self,
        send: Send,
        model: str,
        path: Call | bytes,
        body: bytes,
        steer: Steer,
        ex: Exchange,
        retry: bool = True,
        data: dict[str, Any] | None = None,
    ) -> int:
        """Send to a replica; relay its answer, whatever its status.

        An Endpoint whose server calls the model otherwise gets the body (``data``, a JSON object)
        with its ``"model"`` as the server names it (``Endpoint.upstream_model``); the rest is sent
        as it came, and the answer relayed as it comes.

        A try that could not connect sent nothing and goes to another replica. A try that got no
        answer at all (``BEFORE_ANY_ANSWER``: no status line in time, or the connection closed
        before it) goes once more to another replica when the route may be retried (``retry``);
        its connection is reset first (``HttpClient`` aborts it with a zero linger), so a request
        given up on never reaches that engine later, after a partition heals. An engine that
        answered is never tried again. 503 ``no_replica`` only when no replica was reached; one
        reached that never answered is a 504 (no answer in time) or 502.
        """
        http = self.http
        if http is None:
            raise InternalError("the gateway forwards requests only between start() and stop()")
        tried: set[str] = set()
        last_error = "no replica is ready"
        # The last try that reached a replica and got no answer: the replica and what happened.
        unanswered: tuple[str, UpstreamError] | None = None
        for _ in range(2):
            endpoint = self._pick(model, frozenset(tried), steer, ex)
            if endpoint is None:
                break
            tried.add(endpoint.replica)
            self.in_flight[endpoint.replica] += 1
            try:
                ex.endpoint = endpoint
                ex.sent_at = time.monotonic()
                sent = body
                upstream = endpoint.upstream_model
                if upstream is not None and data is not None and data.get("model") != upstream:
                    sent = orjson.dumps({**data, "model": upstream})
                if endpoint.fields and data is not None:
                    # The adapter the request chose, as its replica's engine is told (a LoRA
                    # adapter's name for vLLM, every adapter's scale for llama.cpp).
                    sent = orjson.dumps({**data, **endpoint.fields})
                try:
                    origin, request = upstream_request(endpoint, path, sent)
                except UpstreamError as exc:  # nothing was sent
                    last_error = f"replica {endpoint.replica}: {exc}"
                    continue
                try:
                    response = await http.request(origin, request, self.upstream_timeout)
                except UpstreamError as exc:
                    # A connect failure ejects the replica at once; so does a request its host
                    # never acknowledged (unreachable, as if no connection could be opened).
                    unreachable = isinstance(exc, NoAnswer) and exc.unacknowledged
                    self.table.failed(endpoint.replica, ConnectFailed(str(exc)) if unreachable else exc)
                    log.warning("try on %s failed: %s (%s)", endpoint.replica, type(exc).__name__, exc)
                    if isinstance(exc, ConnectFailed):
                        last_error = f"replica {endpoint.replica}: {exc}"
                        continue
                    unanswered = (endpoint.replica, exc)
                    if retry and isinstance(exc, BEFORE_ANY_ANSWER):
                        continue
                    break
                # The engine answered: its status and body are the client's (an engine's 5xx is
                # not a failure to reach it, so it neither ejects the replica nor is retried).
                if ex.tap is None or response.status >= 400:
                    return await relay_answer(send, response, ex, self.limits.answer_bytes)
                await relay_stream(send, response, ex, ex.tap)
                return response.status
            finally:
                self.in_flight[endpoint.replica] -= 1
        if unanswered is not None:
            # Reached, never answered: what it generated (if anything) is not known, so the
            # reservation stands.
            return await answer_failed(send, *unanswered)
        ex.usage_total = 0  # nothing was generated
        await send_error(
            send,
            503,
            f"No replica of `{model}` could be reached ({last_error}).",
            "service_unavailable",
            "no_replica",
            retry_after=1,
        )
        return 503


_BLOCK_TOKENS = BLOCK_BYTES // BYTES_PER_TOKEN


class Steer:
    """What a request's prompt says for picking its replica: its prefix key (``prefix-hash``),
    or its chained block keys and estimated tokens (``cache-aware``); computed once per request."""

    __slots__ = ("keys", "prefix", "tokens")

    def __init__(self, prefix: str | None = None, keys: list[int] | None = None, tokens: int = 0) -> None:
        self.prefix = prefix
        self.keys = keys
        self.tokens = tokens


NO_STEER = Steer()


def steer_of(policy: str, replicas: int, data: Mapping[str, Any]) -> Steer:
    """The request's ``Steer`` under ``policy``: nothing to compute with one replica or fewer,
    nor for least-load and round-robin."""
    if replicas < 2:
        return NO_STEER
    if policy == "prefix-hash":
        return Steer(
            prefix=prefix_key_for(data.get("messages") or data.get("prompt") or data.get("input") or "")
        )
    if policy == "cache-aware":
        raw = prompt_bytes(data)
        return Steer(keys=block_keys(raw), tokens=len(raw) // BYTES_PER_TOKEN)
    return NO_STEER


def _reason(
    replica: str,
    policy: str,
    outstanding: int,
    *,
    cached: int | None = None,
    prompt: int | None = None,
) -> bytes:
    """The ``x-fleetserve-pick`` value: the replica picked, the policy, and what the pick weighed."""
    parts = [f"replica={replica}", f"policy={policy}"]
    if cached is not None:
        parts.append(f"cached_tokens={cached}")
    if prompt is not None:
        parts.append(f"prompt_tokens={prompt}")
    parts.append(f"outstanding={outstanding}")
    return "; ".join(parts).encode("ascii", "replace")
