"""The engines' route tables (``EngineSpec.routes``) and the gateway's index of them, as values:
what each path is, which are relayed to API keys, which paths the gateway takes from the server,
what an upstream request carries, and how usage objects of each API shape are read."""

from __future__ import annotations

import orjson
import pytest

from fleetserve.engines.llamacpp import LLAMACPP
from fleetserve.engines.registry import ENGINES
from fleetserve.engines.routes import ApiRoute, ModelBy, RouteKind, UsageBy, find, route_table
from fleetserve.engines.spec import EngineKind
from fleetserve.engines.vllm import VLLM
from fleetserve.gateway.asgi import INDEX, SERVER_PATHS, refusal
from fleetserve.gateway.modelinfo import engine_entry, merged
from fleetserve.gateway.picker import Endpoint
from fleetserve.gateway.sse import Usage, UsageTap, usage_of_body
from fleetserve.gateway.upstream import Call, upstream_request

G, T, C, E, R = (RouteKind.GENERATION, RouteKind.TOKEN_COUNTING, RouteKind.TEMPLATING,
                 RouteKind.EMBEDDINGS, RouteKind.RERANK)  # fmt: skip
TOK, H, M, A = RouteKind.TOKENIZATION, RouteKind.HEALTH, RouteKind.METADATA, RouteKind.ADMIN

# What the issue asks of llama.cpp, path by path (llama-server b11434's server.cpp registers each).
LLAMACPP_ROUTES = [
    ("POST", "/v1/chat/completions", G), ("POST", "/chat/completions", G), ("POST", "/v1/completions", G),
    ("POST", "/completions", G), ("POST", "/completion", G), ("POST", "/infill", G),
    ("POST", "/v1/responses", G), ("POST", "/responses", G), ("POST", "/v1/messages", G),
    ("POST", "/v1/chat/completions/input_tokens", T), ("POST", "/v1/responses/input_tokens", T),
    ("POST", "/v1/messages/count_tokens", T), ("POST", "/v1/embeddings", E), ("POST", "/embeddings", E),
    ("POST", "/embedding", E), ("POST", "/v1/rerank", R), ("POST", "/rerank", R), ("POST", "/reranking", R),
    ("POST", "/tokenize", TOK), ("POST", "/detokenize", TOK), ("POST", "/apply-template", C),
    ("GET", "/props", M), ("GET", "/health", H), ("GET", "/v1/health", H), ("GET", "/v1/models", M),
    ("GET", "/models", M),
]  # fmt: skip

VLLM_ROUTES = [
    ("POST", "/v1/chat/completions", G), ("POST", "/v1/completions", G), ("POST", "/v1/responses", G),
    ("POST", "/v1/messages", G), ("POST", "/v1/messages/count_tokens", T), ("POST", "/v1/embeddings", E),
    ("POST", "/tokenize", TOK), ("POST", "/detokenize", TOK), ("POST", "/rerank", R), ("POST", "/v1/rerank", R),
    ("POST", "/v2/rerank", R), ("POST", "/score", R), ("GET", "/health", H), ("GET", "/v1/models", M),
]  # fmt: skip

# Routes that change an engine's state: never relayed to an API key.
LLAMACPP_ADMIN = [
    ("POST", "/slots/0"), ("POST", "/slots/3"), ("GET", "/slots"), ("POST", "/props"), ("POST", "/lora-adapters"),
    ("GET", "/lora-adapters"), ("GET", "/tools"), ("POST", "/tools"), ("GET", "/cors-proxy"),
    ("POST", "/cors-proxy"), ("POST", "/models/load"), ("POST", "/models/unload"), ("POST", "/models"),
    ("DELETE", "/models"),
]  # fmt: skip
VLLM_ADMIN = [
    ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"), ("POST", "/sleep"),
    ("POST", "/wake_up"), ("POST", "/reset_prefix_cache"), ("POST", "/collective_rpc"), ("POST", "/update_weights"),
    ("POST", "/pause"), ("POST", "/start_profile"),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "kind"), LLAMACPP_ROUTES)
def test_llamacpp_routes_are_in_its_row_with_their_kind_and_relayed_to_keys(method, path, kind):
    route = find(LLAMACPP.routes, method, path)
    assert route is not None and route.kind is kind and route.keys and route.retry


@pytest.mark.parametrize(("method", "path", "kind"), VLLM_ROUTES)
def test_vllm_routes_are_in_its_row_with_their_kind_and_relayed_to_keys(method, path, kind):
    route = find(VLLM.routes, method, path)
    assert route is not None and route.kind is kind and route.keys and route.retry


@pytest.mark.parametrize(
    ("engine", "method", "path"), [(LLAMACPP, *r) for r in LLAMACPP_ADMIN] + [(VLLM, *r) for r in VLLM_ADMIN]
)
def test_state_changing_routes_are_admin_and_never_for_keys(engine, method, path):
    route = find(engine.routes, method, path)
    assert route is not None and route.kind is RouteKind.ADMIN and not route.keys and route.why
    routes = INDEX.lookup(method, path)
    assert routes is not None and refusal(routes) is not None  # refused before any key is read


def test_every_row_is_consistent():
    for engine in ENGINES.values():
        assert engine.routes, engine.kind
        for (method, path), route in engine.routes.items():
            assert (route.method, route.path) == (method, path)
            assert path.startswith("/") and method in {"GET", "POST", "DELETE"}
            # Every client route may be retried when its try got no answer at all; none that
            # changes state is relayed; a route refused to keys says why.
            assert route.retry == route.keys, (engine.kind, path)
            assert route.kind is not RouteKind.ADMIN or not route.keys, (engine.kind, path)
            assert route.keys or route.why, (engine.kind, path)
            # A GET has no body to name its model or carry usage.
            if method == "GET":
                assert route.model_by is ModelBy.QUERY and route.usage is UsageBy.NONE, (engine.kind, path)
            # Only generation, embeddings and rerank produce tokens to count.
            if route.kind in (RouteKind.TOKEN_COUNTING, RouteKind.TOKENIZATION, RouteKind.TEMPLATING):
                assert route.usage is UsageBy.NONE, (engine.kind, path)
            if route.usage is UsageBy.STREAM_OPTION:
                assert path.endswith(("/chat/completions", "/v1/completions")), (engine.kind, path)


def test_a_route_listed_twice_is_refused():
    route = ApiRoute("POST", "/x", RouteKind.GENERATION)
    with pytest.raises(ValueError, match="listed twice"):
        route_table((route,), (route,))


def test_the_index_takes_engine_paths_but_never_the_servers_own():
    for path in ("/completion", "/infill", "/tokenize", "/chat/completions", "/models", "/props", "/health",
                 "/apply-template", "/v1/anything", "/slots/0", "/score"):  # fmt: skip
        assert INDEX.owns(path), path
    for path in (
        "/metrics",
        "/healthz",
        "/",
        "/api/v1/models",
        "/api/v1/agent/heartbeat",
        "/ui",
        "/ui/nodes",
    ):
        assert not INDEX.owns(path), path
    assert INDEX.lookup("GET", "/metrics") is None
    assert not (INDEX.native & SERVER_PATHS)


def test_no_engine_path_shadows_a_route_of_the_server(tmp_path):
    from fleetserve.server.app import create_app
    from fleetserve.store.sql import SqlStore

    with SqlStore.open(tmp_path / "state.db") as store:
        app = create_app(store)
        paths = {getattr(r, "path", "") for r in app.routes}
    assert paths, "the server app lists its routes"
    taken = {p for p in paths if p and INDEX.owns(p) and not p.startswith("/v1/")}
    assert taken == set(), taken


def test_a_path_served_by_one_engine_only_is_known_per_engine():
    routes = INDEX.lookup("POST", "/infill")
    assert routes is not None and set(routes) == {EngineKind.LLAMACPP}
    routes = INDEX.lookup("POST", "/score")
    assert routes is not None and set(routes) == {EngineKind.VLLM}
    # The exact llama.cpp route wins over vLLM's stored-response prefix, which it is not relayed by.
    routes = INDEX.lookup("POST", "/v1/responses/input_tokens")
    assert routes is not None and routes[EngineKind.LLAMACPP].kind is RouteKind.TOKEN_COUNTING
    assert not routes[EngineKind.VLLM].keys
    assert refusal(routes) is None  # a llama.cpp deployment serves it
    assert INDEX.methods["/props"] == ("GET", "POST")
    assert INDEX.lookup("PUT", "/props") is None


def test_an_upstream_call_forwards_the_query_and_the_allowed_headers_only():
    headers = [
        (b"authorization", b"Bearer client-key"), (b"x-api-key", b"client-key"), (b"cookie", b"s=1"),
        (b"proxy-authorization", b"Basic x"), (b"connection", b"close"), (b"accept", b"text/event-stream"),
        (b"x-conversation-id", b"conv-1"), (b"anthropic-version", b"2023-06-01"), (b"openai-beta", b"assistants=v2"),
        (b"x-request-id", b"r1"), (b"host", b"gateway"), (b"transfer-encoding", b"chunked"),
    ]  # fmt: skip
    call = Call.of("POST", b"/slots/0", b"action=erase", headers, True)
    assert call is not None
    _, request = upstream_request(Endpoint("r", "http://127.0.0.1:9", engine_key="k1"), call, b"{}")
    head = request.split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"post /slots/0?action=erase http/1.1\r\n")
    for kept in (b"accept: text/event-stream", b"x-conversation-id: conv-1", b"anthropic-version: 2023-06-01",
                 b"openai-beta: assistants=v2", b"x-request-id: r1", b"authorization: bearer k1"):  # fmt: skip
        assert kept in head, kept
    for gone in (b"client-key", b"cookie", b"proxy-", b"connection", b"transfer-encoding", b"host: gateway"):
        assert gone not in head, gone
    get = Call.of("GET", b"/props", b"model=tiny", [], False)
    assert get is not None
    _, request = upstream_request(Endpoint("r", "http://127.0.0.1:9"), get, b"")
    assert request == b"GET /props?model=tiny HTTP/1.1\r\nHost: 127.0.0.1:9\r\n\r\n"
    assert Call.of("GET", b"/props", b"a=1\r\nX-Evil: 1", [], False) is None
    assert Call.of("GET", b"/props x", b"", [], False) is None


def test_usage_objects_of_every_api_shape_are_counted():
    openai = usage_of_body(b'{"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}')
    anthropic = usage_of_body(
        b'{"type":"message","usage":{"input_tokens":3,"cache_read_input_tokens":2,"output_tokens":4}}'
    )
    responses = usage_of_body(
        b'{"object":"response","usage":{"input_tokens":3,"output_tokens":4,"total_tokens":7}}'
    )
    assert openai is not None and (openai.prompt, openai.completion, openai.total) == (3, 4, 7)
    assert anthropic is not None and (anthropic.prompt, anthropic.completion, anthropic.total) == (5, 4, 9)
    assert responses is not None and (responses.prompt, responses.completion, responses.total) == (3, 4, 7)
    assert Usage({}).total == 0


def test_an_anthropic_stream_is_counted_and_passed_on_unchanged():
    start = {
        "type": "message_start",
        "message": {"id": "m", "usage": {"input_tokens": 6, "output_tokens": 0}},
    }
    delta = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 9}}
    stream = (
        b"event: message_start\ndata: " + orjson.dumps(start) + b"\n\n"
        b"event: message_delta\ndata: " + orjson.dumps(delta) + b"\n\n"
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
    tap = UsageTap(strip=False)
    out = tap.feed(stream) + tap.flush()
    assert out == stream
    assert tap.usage is not None and (tap.usage.prompt, tap.usage.completion, tap.usage.total) == (6, 9, 15)


def test_a_responses_stream_usage_is_read_from_its_completed_event():
    done = {
        "type": "response.completed",
        "response": {"usage": {"input_tokens": 2, "output_tokens": 5, "total_tokens": 7}},
    }
    stream = b"event: response.completed\ndata: " + orjson.dumps(done) + b"\n\n"
    tap = UsageTap(strip=True)  # never stripped: the engine sends it unasked
    assert tap.feed(stream) + tap.flush() == stream
    assert tap.usage is not None and tap.usage.total == 7


def test_models_entries_keep_openais_types_and_add_the_engines_fields():
    llamacpp = engine_entry(
        b'{"models":[],"object":"list","data":[{"id":"tiny.gguf","object":"model","created":1,'
        b'"owned_by":"llamacpp","aliases":["a"],"meta":{"n_ctx":256,"n_params":100}}]}'
    )
    entry = merged("tiny", 1700000000, llamacpp)
    assert entry["id"] == "tiny" and entry["object"] == "model" and entry["created"] == 1700000000
    assert entry["owned_by"] == "llamacpp" and entry["meta"]["n_ctx"] == 256 and entry["aliases"] == ["a"]
    vllm = engine_entry(
        b'{"object":"list","data":[{"id":"m","object":"model","created":5,"owned_by":"vllm",'
        b'"root":"/models/m","parent":null,"max_model_len":4096}]}'
    )
    entry = merged("m", 7, vllm)
    assert entry == {"id": "m", "object": "model", "created": 7, "owned_by": "vllm", "max_model_len": 4096}
    assert merged("x", 3, None) == {"id": "x", "object": "model", "created": 3, "owned_by": "fleetserve"}
    assert merged("x", 3, {"owned_by": 5}) == {
        "id": "x",
        "object": "model",
        "created": 3,
        "owned_by": "fleetserve",
    }
    assert engine_entry(b"not json") is None and engine_entry(b'{"data":[]}') is None
