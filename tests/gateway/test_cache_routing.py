"""Cache-aware routing through real gateways: two gateways (two Gateway objects, each served by
uvicorn) over one store in front of two fake engines. Each learns only what it routed itself, its
pick's reason is told to a client that asks, its /metrics counts routed and expected-cached prompt
tokens, and distinct prefixes still spread over both replicas. Also: the observer's engine epoch,
which clears a restarted engine's model."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime

import httpx
import pytest

from fake_engine import ServedGateway, engines_on
from fleetserve.gateway.prefixcache import block_keys, prompt_bytes
from fleetserve.metrics.exposition import FleetMetrics
from fleetserve.server.observer import Observer
from fleetserve.store.sql import SqlStore

DEBUG = {"x-fleetserve-debug": "pick"}


def wait_for(check, timeout: float = 10.0, what: str = "it"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def routed(gw: ServedGateway, n: int) -> bool:
    route = gw.gateway.table.routes.get("tiny")
    return route is not None and len(route.endpoints) == n


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServedGateway, ServedGateway, str]]:
    tmp = tmp_path_factory.mktemp("cache")
    with (
        SqlStore.open(tmp / "state.db") as store,
        ServedGateway(store, engines=2) as first,
        ServedGateway(store, engines=0) as second,
    ):
        engines_on(store, [e.port for e in first.engines], tmp / "tiny.gguf")
        wait_for(lambda: routed(first, 2) and routed(second, 2), what="both replicas in both gateways")
        _, token = store.create_api_key("cache", ["*"], None, None, datetime.now(UTC))
        yield first, second, token


def chat(system: str, user: str = "hello") -> dict[str, object]:
    return {
        "model": "tiny",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 2,
    }


def reason(answer: httpx.Response) -> dict[str, str]:
    assert answer.status_code == 200, answer.text
    value = answer.headers["x-fleetserve-pick"]
    return dict(part.split("=", 1) for part in value.split("; "))


def ask(gw: ServedGateway, token: str, body: dict[str, object], debug: bool = True) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}", **(DEBUG if debug else {})}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=30)


def metric(gw: ServedGateway, name: str) -> float:
    text = httpx.get(f"{gw.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f'{name}{{deployment="tiny"}}'):
            return float(line.split()[-1])
    return 0.0


def test_each_gateway_learns_only_what_it_routed(two):
    first, second, token = two
    system = "You are a careful assistant of the fleet. " * 60  # about 2,500 bytes: 39 blocks
    picks = [reason(ask(first, token, chat(system, f"question {i}"))) for i in range(6)]
    home = picks[0]["replica"]
    assert picks[0]["policy"] == "cache-aware" and picks[0]["cached_tokens"] == "0"
    # One at a time, every later request goes where the system prompt is cached, and says so.
    assert {p["replica"] for p in picks} == {home}
    assert all(int(p["cached_tokens"]) >= 2400 // 4 - 16 for p in picks[1:])
    assert all(int(p["prompt_tokens"]) >= 2500 // 4 for p in picks)
    keys = block_keys(prompt_bytes(chat(system, "question 9")))
    assert first.gateway.caches.cached_tokens(home, keys) > 0
    # The other gateway routed none of them: it knows nothing of that prefix.
    assert all(second.gateway.caches.cached_tokens(r, keys) == 0 for r in ("tiny-0", "tiny-1"))
    theirs = reason(ask(second, token, chat(system, "question 10")))
    assert theirs["cached_tokens"] == "0"
    # ... until it routes one itself.
    again = reason(ask(second, token, chat(system, "question 11")))
    assert again["replica"] == theirs["replica"] and int(again["cached_tokens"]) > 0
    # Its counters: every routed prompt's tokens, and those expected cached.
    assert metric(first, "fleetserve_gateway_prompt_tokens_routed_total") >= 6 * 600
    assert metric(first, "fleetserve_gateway_prompt_tokens_cached_expected_total") >= 5 * 580


def test_distinct_prefixes_spread_over_both_replicas_from_both_gateways(two):
    first, second, token = two
    for gw in (first, second):
        seen = Counter(
            reason(ask(gw, token, chat(f"Group {g} has its own system prompt. " * 40)))["replica"]
            for g in range(16)
        )
        assert set(seen) == {"tiny-0", "tiny-1"}, seen


def test_the_pick_is_told_only_to_a_client_that_asks(two):
    first, _, token = two
    plain = ask(first, token, chat("x" * 500), debug=False)
    assert plain.status_code == 200 and "x-fleetserve-pick" not in plain.headers
    told = reason(ask(first, token, chat("x" * 500)))
    # Its own deployment's replica, the policy and the figures it weighed; nothing else.
    assert set(told) == {"replica", "policy", "cached_tokens", "prompt_tokens", "outstanding"}
    assert told["replica"] in ("tiny-0", "tiny-1")


def test_the_observer_bumps_an_engine_s_epoch_when_it_restarted(tmp_path):
    with SqlStore.open(tmp_path / "state.db") as store:
        observer = Observer(store, FleetMetrics())
        observer._count_prompt_tokens("r", 100.0)
        observer._count_prompt_tokens("r", 250.0)
        assert observer.epochs.get("r", 0) == 0
        observer._count_prompt_tokens("r", 3.0)  # the counter went back: a new process
        assert observer.epochs["r"] == 1
        observer.restarts([("d", "r", 0)])
        observer.restarts([("d", "r", 2)])  # its agent reported restarts
        assert observer.epochs["r"] == 2


@pytest.mark.parametrize(
    ("routing", "policy"),
    [
        ({"policy": "round-robin"}, "round-robin"),
        ({"policy": "least-load"}, "least-load"),
        ({"prefixAffinity": True}, "prefix-hash"),
    ],
)
def test_the_deployment_s_policy_is_the_one_picking(two, routing, policy):
    """The spec's ``routing`` reaches every gateway's route: round robin alternates on one prompt,
    least-load and prefix-hash say so; then the default (cache-aware) again."""
    from builders import deployment

    first, second, token = two
    profile = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}}
    store = first.store
    try:
        store.put_deployment(deployment("tiny", 2, profile, model="tiny", routing=routing))
        wait_for(
            lambda: all(gw.gateway.table.routes["tiny"].routing == policy for gw in (first, second)),
            what=f"both gateways to route tiny by {policy}",
        )
        system = "One prompt for every request. " * 40
        picks = [reason(ask(first, token, chat(system))) for _ in range(4)]
        assert {p["policy"] for p in picks} == {policy}
        replicas = [p["replica"] for p in picks]
        if policy == "round-robin":
            assert replicas[0] != replicas[1] and replicas[:2] == replicas[2:]
        if policy == "prefix-hash":
            assert len(set(replicas)) == 1  # one prompt, one home on the ring
    finally:
        store.put_deployment(deployment("tiny", 2, profile, model="tiny"))
        wait_for(
            lambda: all(gw.gateway.table.routes["tiny"].routing == "cache-aware" for gw in (first, second)),
            what="both gateways back to cache-aware",
        )
