"""What each HTTP route of an engine is, as the gateway sees it: one typed row per method and path.

An engine row (``EngineSpec.routes``) lists every route its server registers, read from the
engine's source: llama.cpp's ``tools/server/server.cpp`` (build b11434, the one fleetserve builds
and ships) and vLLM's ``vllm/entrypoints/**/api_router.py`` (0.32, the pinned CPU build). The
gateway relays the routes an API key may call (``keys``), refuses the rest in OpenAI's error shape
with the row's ``why``, and reads nothing else about an engine's API: a path is served for a
deployment only when every engine its profiles run lists it.

Each transformation the gateway makes on a route is named in its row (style.md, "Faithful by
default"): how the model is found (``model_by``: the engine is never told, it ignores the body's
``"model"``), how tokens are counted (``usage``), whether a try that got no answer may be tried on
another replica (``retry``), and whether the gateway answers itself (``by_gateway``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from fleetserve.engines.spec import Task


class RouteKind(StrEnum):
    """What a route does."""

    GENERATION = "generation"
    TOKEN_COUNTING = "token_counting"
    TEMPLATING = "templating"
    TOKENIZATION = "tokenization"
    EMBEDDINGS = "embeddings"
    RERANK = "rerank"
    HEALTH = "health"
    METADATA = "metadata"
    ADMIN = "admin"


# The route kinds a deployment serves only where it declares the task (``Deployment.task``); every
# other kind (tokenization, health, metadata) is served whatever the task. A chat request to an
# embedding model is refused by the gateway, not sent to an engine started without a chat runner.
TASK_OF_KIND: Mapping[RouteKind, Task] = MappingProxyType(
    {
        RouteKind.GENERATION: Task.GENERATE,
        RouteKind.TOKEN_COUNTING: Task.GENERATE,
        RouteKind.TEMPLATING: Task.GENERATE,
        RouteKind.EMBEDDINGS: Task.EMBED,
        RouteKind.RERANK: Task.RERANK,
    }
)
# What the kinds a route needs are called in a refusal.
_KIND_WORDS: Mapping[Task, str] = MappingProxyType(
    {Task.GENERATE: "generation", Task.EMBED: "embeddings", Task.RERANK: "reranking"}
)


def task_refusal(kind: RouteKind, task: Task | None, model: str, method: str, path: str) -> str | None:
    """Why a deployment of ``task`` does not serve a route of ``kind`` (a 400's message), or None
    when it does (``task`` None: an Endpoint's model, whose server says for itself)."""
    needs = TASK_OF_KIND.get(kind)
    if task is None or needs is None or needs is task:
        return None
    return (
        f"`{model}` is deployed for task {task.value} (it serves {_KIND_WORDS[task]}): "
        f"{method} {path} needs a deployment of task {needs.value}."
    )


class ModelBy(StrEnum):
    """How a request to a route names the deployment it is for."""

    # The JSON body's "model", required (the OpenAI and Anthropic APIs).
    BODY = "body"
    # The JSON body's "model" where it has one, else ``?model=``, else the one model the key may use
    # (llama.cpp's own routes, whose clients send no model: /completion, /infill, /tokenize ...).
    BODY_OR_DEFAULT = "body_or_default"
    # A GET without a body: ``?model=``, else the one model the key may use (llama.cpp's router mode
    # names the model of /props the same way).
    QUERY = "query"


class UsageBy(StrEnum):
    """Where the tokens of an answer are counted from (``gateway/sse.py`` reads both shapes of usage
    object: OpenAI's ``prompt_tokens``/``completion_tokens`` and Anthropic's and the Responses
    API's ``input_tokens``/``output_tokens``)."""

    # A usage object in the answer's body; a stream carries it only when the request asks with
    # ``stream_options.include_usage`` (OpenAI Chat Completions and Completions): the gateway may ask.
    STREAM_OPTION = "stream_option"
    # A usage object in the body, and in a stream's own events without being asked (Anthropic
    # ``message_start``/``message_delta``, Responses ``response.completed``): never asked for.
    BODY = "body"
    # llama.cpp's own answers (/completion, /infill): no usage object, but ``tokens_evaluated``
    # (the prompt) and ``tokens_predicted`` (generated) on the answer, on each object of a list (one
    # per prompt), and in a stream on every event, the final one of each prompt (``"stop": true``)
    # holding its totals. Read as they are; nothing is asked for.
    COUNTS = "counts"
    # Nothing is generated: no tokens are reserved or counted (token counting, tokenization, health).
    NONE = "none"


@dataclass(frozen=True)
class ApiRoute:
    """One route of an engine's server: method and path, and what the gateway does with it."""

    method: str
    path: str
    kind: RouteKind
    model_by: ModelBy = ModelBy.BODY
    usage: UsageBy = UsageBy.NONE
    # May a try that got no answer at all (no connection, nothing sent back) go to another replica.
    # Every client route may: nothing reached the engine that could have run.
    retry: bool = True
    # Whether an API key may call it. Routes that change an engine's state (its slots, adapters,
    # settings, tools, loaded models) are for operators, never relayed to keys.
    keys: bool = True
    # The path is a prefix: ``/slots/`` matches ``/slots/0``.
    prefix: bool = False
    # Answered by the gateway itself, from what the engines say (``/v1/models``), not relayed.
    by_gateway: bool = False
    # What it is; for a route keys may not call, why (the refusal says it).
    why: str = ""


def client(
    method: str,
    paths: Iterable[str],
    kind: RouteKind,
    model_by: ModelBy = ModelBy.BODY,
    usage: UsageBy = UsageBy.NONE,
    why: str = "",
) -> tuple[ApiRoute, ...]:
    """Routes an API key may call, one per path (aliases of one handler)."""
    return tuple(ApiRoute(method, p, kind, model_by, usage, why=why) for p in paths)


def admin(method: str, paths: Iterable[str], why: str, *, prefix: bool = False) -> tuple[ApiRoute, ...]:
    """Routes never relayed to an API key, with the reason its refusal gives."""
    return tuple(
        ApiRoute(method, p, RouteKind.ADMIN, ModelBy.QUERY, retry=False, keys=False, prefix=prefix, why=why)
        for p in paths
    )


def unrelayed(
    method: str, paths: Iterable[str], kind: RouteKind, why: str, *, prefix: bool = False
) -> tuple[ApiRoute, ...]:
    """Client routes the gateway cannot relay faithfully (``why``), refused to keys as admin ones are."""
    return tuple(
        ApiRoute(method, p, kind, ModelBy.QUERY, retry=False, keys=False, prefix=prefix, why=why)
        for p in paths
    )


def by_gateway(paths: Iterable[str]) -> tuple[ApiRoute, ...]:
    """GET routes the gateway answers itself, from what the engines say (the model list)."""
    return tuple(ApiRoute("GET", p, RouteKind.METADATA, ModelBy.QUERY, by_gateway=True) for p in paths)


def route_table(*groups: Iterable[ApiRoute]) -> Mapping[tuple[str, str], ApiRoute]:
    """An engine's routes by (method, path); a (method, path) listed twice is a mistake in the row."""
    table: dict[tuple[str, str], ApiRoute] = {}
    for group in groups:
        for route in group:
            at = (route.method, route.path)
            if at in table:
                raise ValueError(f"route {route.method} {route.path} listed twice")
            table[at] = route
    return MappingProxyType(table)


def find(routes: Mapping[tuple[str, str], ApiRoute], method: str, path: str) -> ApiRoute | None:
    """The route ``method path`` reaches in ``routes``: exact, else the longest prefix route."""
    exact = routes.get((method, path))
    if exact is not None:
        return exact
    best: ApiRoute | None = None
    for route in routes.values():
        fits = route.prefix and route.method == method and path.startswith(route.path)
        if fits and (best is None or len(route.path) > len(best.path)):
            best = route
    return best


OPERATOR_ONLY = "it changes the engine's state; only the fleet's operators may, not an API key"
"""The reason given for refusing an admin route to an API key."""
