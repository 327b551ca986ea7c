"""What an engine says about the model it serves, merged into the gateway's ``/v1/models``.

The gateway lists its deployments in OpenAI's shape (``id``: the deployment, ``object``,
``created``: when it was applied, ``owned_by``: the engine's word, else ``fleetserve``, and ``task``:
what the deployment serves, ``generate``, ``embed`` or ``rerank``) and adds the
engine's own fields under each entry: llama.cpp's ``meta`` (``n_ctx``, ``n_ctx_train``,
``n_params``, ``size`` ...), ``aliases``, ``tags`` and ``architecture``; vLLM's ``max_model_len``.
Left out: what names the engine's host (vLLM's ``root`` and ``parent``: the path it loaded), and
the engine's own ``id``, ``object`` and ``created``, which are fleetserve's to say.

What an engine says is asked once per replica (``GET /v1/models`` on one Ready replica), kept for
the replica's life (its names are never reused), and asked again after ``RETRY_SECONDS`` when the
engine did not answer; a model with no Ready replica lists with what fleetserve knows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from fleetserve.engines.spec import Task
from fleetserve.gateway.picker import Endpoint
from fleetserve.gateway.upstream import REDACTED, Call, upstream_request
from fleetserve.httpclient import HttpClient, UpstreamError

log = logging.getLogger("fleetserve.gateway")

ASK_SECONDS = 2.0
"""How long a listing waits for an engine's answer."""

RETRY_SECONDS = 10.0
"""How long an engine that did not answer is not asked again."""

OPENAI_FIELDS = ("id", "object", "created", "owned_by")
HOST_FIELDS = frozenset({"root", "parent"})
MODELS_CALL = Call(b"GET", b"/v1/models", body=False)


def engine_entry(answer: bytes, upstream: str | None = None) -> dict[str, Any] | None:
    """The model entry of an engine's ``/v1/models`` answer: its first, or for an Endpoint (which
    may serve many) the one whose ``id`` is ``upstream``; None when there is none."""
    try:
        data = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    listed = data.get("data") if isinstance(data, dict) else None
    if not isinstance(listed, list):
        return None
    if upstream is not None:
        return next((e for e in listed if isinstance(e, dict) and e.get("id") == upstream), None)
    first = listed[0] if listed else None
    return first if isinstance(first, dict) else None


def info_key(endpoint: Endpoint) -> str:
    """What an engine's word is kept under: its replica, and for an Endpoint (which may serve
    several models) the model too."""
    return (
        endpoint.replica
        if endpoint.upstream_model is None
        else f"{endpoint.replica}#{endpoint.upstream_model}"
    )


def merged(
    name: str,
    created: int,
    engine: Mapping[str, Any] | None,
    task: Task | None = None,
    parent: str | None = None,
) -> dict[str, Any]:
    """One ``/v1/models`` entry: OpenAI's fields as fleetserve says them, then the engine's own,
    then fleetserve's ``task`` (what the deployment serves; absent for a model only Endpoints
    serve, whose servers say for themselves) and, for a LoRA adapter, its ``parent`` (the
    deployment of its base model, the name vLLM's own list gives an adapter's base)."""
    owned = engine.get("owned_by") if engine is not None else None
    entry: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": owned if isinstance(owned, str) and owned else "fleetserve",
    }
    if engine is not None:
        for field, value in engine.items():
            if field not in OPENAI_FIELDS and field not in HOST_FIELDS and field != "task":
                entry[field] = value
    if task is not None:
        entry["task"] = task.value
    if parent is not None:
        entry["parent"] = parent
    return entry


class ModelInfo:
    """What each replica's engine says about its model, asked once per replica."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self.known: dict[str, dict[str, Any]] = {}
        self.failed: dict[str, float] = {}  # replica → when it may be asked again

    def of(self, endpoints: Iterable[Endpoint]) -> dict[str, Any] | None:
        """What one of ``endpoints`` said, if one has been asked."""
        return next((self.known[info_key(e)] for e in endpoints if info_key(e) in self.known), None)

    def keep_only(self, endpoints: Iterable[Endpoint]) -> None:
        """Forget replicas (and Endpoints' models) no longer routed."""
        live = {info_key(e) for e in endpoints}
        for gone in [r for r in self.known if r not in live]:
            del self.known[gone]
        for gone in [r for r in self.failed if r not in live]:
            del self.failed[gone]

    def to_ask(self, endpoints: tuple[Endpoint, ...]) -> Endpoint | None:
        """The replica to ask for a deployment that has none asked yet (the first not failing)."""
        if self.of(endpoints) is not None:
            return None
        now = self.clock()
        return next((e for e in endpoints if self.failed.get(info_key(e), 0.0) <= now), None)

    async def ask(self, http: HttpClient, endpoints: Iterable[Endpoint]) -> None:
        """Ask each of ``endpoints`` at once, within ``ASK_SECONDS``; keep what they say."""
        asked = list(endpoints)
        if asked:
            await asyncio.gather(*(self._ask(http, e) for e in asked))

    async def _ask(self, http: HttpClient, endpoint: Endpoint) -> None:
        try:
            entry = await asyncio.wait_for(self._fetch(http, endpoint), ASK_SECONDS)
        except (TimeoutError, UpstreamError) as exc:
            log.info("asking %s for its model failed: %s", endpoint.replica, exc)
            entry = None
        if entry is None:
            self.failed[info_key(endpoint)] = self.clock() + RETRY_SECONDS
        else:
            self.known[info_key(endpoint)] = entry

    async def _fetch(self, http: HttpClient, endpoint: Endpoint) -> dict[str, Any] | None:
        origin, request = upstream_request(endpoint, MODELS_CALL, b"")
        response = await http.request(origin, request, ASK_SECONDS)
        try:
            if response.status != 200:
                return None
            said = await response.read()
            if endpoint.redact and endpoint.engine_key:  # never list an Endpoint's key to a client
                said = said.replace(endpoint.engine_key.encode("latin-1"), REDACTED)
            return engine_entry(said, endpoint.upstream_model)
        finally:
            response.close()
