"""The gateway's endpoint table over an in-memory RouteSource: no database, the routing rule alone."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import pytest

from builders import deployment
from fleetserve.changegate import ChangeGate
from fleetserve.endpointkeys import EndpointKeys
from fleetserve.errors import StoreError
from fleetserve.gateway.endpoints import EJECT_MAX_SECONDS, EJECT_SECONDS, Ejections, EndpointTable
from fleetserve.httpclient import ConnectFailed, UpstreamBroke, UpstreamTimeout
from fleetserve.protocol import ReplicaStatus
from fleetserve.routing import ReplicaEndpoint, engine_auth, routable
from fleetserve.secretfile import write_secret
from fleetserve.spec.endpoint import Endpoint, EndpointState
from fleetserve.spec.resources import Deployment, NodeState, Replica, ReplicaState, Shard
from fleetserve.store.deployments import StoredDeployment
from fleetserve.store.endpoints import StoredEndpoint
from fleetserve.store.protocols import RouteSource

VLLM_TP2 = {"name": "tp2", "engine": "vllm", "deviceClass": "h100", "devicesPerNode": 2}
LLAMA_CPU = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 2}}


@dataclass
class Routes:
    """A RouteSource held in memory. Its lists are changed in place, so its change counter moves at
    every look (these tests are about the routing rule; the gate is tested over the SQL stores)."""

    deployments: list[StoredDeployment] = field(default_factory=list)
    endpoints: list[ReplicaEndpoint] = field(default_factory=list)
    upstreams: list[StoredEndpoint] = field(default_factory=list)
    looks: int = 0

    def fleet_changes(self) -> int:
        self.looks += 1
        return self.looks

    def list_deployments(self) -> list[StoredDeployment]:
        return list(self.deployments)

    def replica_endpoints(self) -> list[ReplicaEndpoint]:
        return list(self.endpoints)

    def list_endpoints(self) -> list[StoredEndpoint]:
        return list(self.upstreams)


def stored(*deps: Deployment) -> list[StoredDeployment]:
    return [StoredDeployment(d, 1, {}) for d in deps]


def endpoint(
    name: str,
    dep: str,
    profile: str,
    address: str,
    port: int | None,
    state: ReplicaState = ReplicaState.RUNNING,
    devices: tuple[int, ...] = (),
    node_state: NodeState = NodeState.READY,
) -> ReplicaEndpoint:
    shard = Shard(node="n1", devices=devices)
    replica = Replica(name=name, deployment=dep, profile=profile, shards=(shard,), state=state)
    return ReplicaEndpoint(replica, address, ReplicaStatus(port=port), node_state=node_state)


def test_only_running_replicas_with_a_port_on_an_addressed_node_are_routed():
    source: RouteSource = Routes(
        stored(deployment("chat", 4, LLAMA_CPU)),
        [
            endpoint("chat-0", "chat", "cpu", "10.0.0.1", 8001),
            endpoint("chat-1", "chat", "cpu", "10.0.0.2", None),  # no port reported yet
            endpoint("chat-2", "chat", "cpu", "", 8003),  # node without an address
            endpoint("chat-3", "chat", "cpu", "10.0.0.4", 8004, ReplicaState.STARTING),
        ],
    )
    routes = EndpointTable(source).load()
    assert [e.replica for e in routes["chat"].endpoints] == ["chat-0"]
    assert routes["chat"].endpoints[0].url == "http://10.0.0.1:8001"


def test_an_ipv6_address_is_bracketed_once_and_devices_weigh_the_endpoint():
    source = Routes(
        stored(deployment("big", 1, VLLM_TP2)),
        [endpoint("big-0", "big", "tp2", "fd00::7", 8000, devices=(0, 1))],
    )
    (served,) = EndpointTable(source).load()["big"].endpoints
    assert served.url == "http://[fd00::7]:8000"
    assert served.weight == 2.0


def test_a_deployment_without_replicas_has_a_route_with_no_endpoints_and_its_engines_concurrency():
    routes = EndpointTable(Routes(stored(deployment("idle", {"min": 0, "max": 2}, LLAMA_CPU)))).load()
    assert routes["idle"].endpoints == ()
    assert routes["idle"].scales_from_zero is True
    assert routes["idle"].concurrency_per_replica == 4


def test_the_observer_and_the_gateway_read_the_same_rule():
    endpoints = [
        endpoint("a-0", "a", "cpu", "::1", 9000),
        endpoint("a-1", "a", "cpu", "127.0.0.1", None),
    ]
    assert [(r.replica.name, r.url) for r in routable(endpoints)] == [("a-0", "http://[::1]:9000")]


def test_each_endpoint_carries_its_replicas_engine_key_to_the_gateway_and_the_observer():
    keyed = ReplicaEndpoint(
        endpoint("k-0", "k", "cpu", "10.0.0.1", 8001).replica, "10.0.0.1", ReplicaStatus(port=8001), "key-0"
    )
    old = endpoint("k-1", "k", "cpu", "10.0.0.2", 8002)  # placed before engine keys
    source = Routes(stored(deployment("k", 2, LLAMA_CPU)), [keyed, old])
    served = {e.replica: e for e in EndpointTable(source).load()["k"].endpoints}
    assert served["k-0"].engine_key == "key-0" and served["k-1"].engine_key is None
    assert "key-0" not in repr(served["k-0"]) and "key-0" not in repr(keyed)
    assert [r.engine_key for r in routable([keyed, old])] == ["key-0", None]
    assert engine_auth("key-0") == {"Authorization": "Bearer key-0"} and engine_auth(None) == {}


def test_replicas_on_nodes_not_ready_or_lost_and_engines_failing_health_are_not_routed():
    # The agent reports an engine whose health check fails as Starting ("health check failing").
    source = Routes(
        stored(deployment("chat", 4, LLAMA_CPU)),
        [
            endpoint("chat-0", "chat", "cpu", "10.0.0.1", 8001),
            endpoint("chat-1", "chat", "cpu", "10.0.0.2", 8002, node_state=NodeState.NOT_READY),
            endpoint("chat-2", "chat", "cpu", "10.0.0.3", 8003, node_state=NodeState.LOST),
            endpoint("chat-3", "chat", "cpu", "10.0.0.4", 8004, ReplicaState.STARTING),
        ],
    )
    assert [e.replica for e in EndpointTable(source).load()["chat"].endpoints] == ["chat-0"]


def test_a_node_judged_not_ready_leaves_the_routes_at_the_next_refresh():
    source = Routes(
        stored(deployment("chat", 2, LLAMA_CPU)),
        [
            endpoint("chat-0", "chat", "cpu", "10.0.0.1", 8001),
            endpoint("chat-1", "chat", "cpu", "10.0.0.2", 8002),
        ],
    )
    changed: list[str] = []
    table = EndpointTable(source, on_change=changed.append)
    asyncio.run(table.refresh())
    assert len(table.routes["chat"].endpoints) == 2
    source.endpoints[1] = endpoint("chat-1", "chat", "cpu", "10.0.0.2", 8002, node_state=NodeState.NOT_READY)
    asyncio.run(table.refresh())
    assert [e.replica for e in table.routes["chat"].endpoints] == ["chat-0"]
    assert changed == ["chat", "chat"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_ejected_endpoint_is_out_for_a_backoff_that_doubles_in_a_row_and_starts_over_after_quiet():
    clock = Clock()
    ejections = Ejections(clock=clock)
    assert ejections.eject("a") == EJECT_SECONDS
    assert ejections.ejected(["a", "b"]) == {"a"}
    clock.now += EJECT_SECONDS + 0.01
    assert ejections.ejected(["a", "b"]) == frozenset()
    assert ejections.eject("a") == 2 * EJECT_SECONDS  # failed again as soon as it was back
    assert ejections.eject("a") == 4 * EJECT_SECONDS
    for _ in range(10):
        ejections.eject("a")
    assert ejections.until["a"] - clock.now == pytest.approx(EJECT_MAX_SECONDS)
    clock.now += 3 * EJECT_MAX_SECONDS  # a quiet spell: the next failure starts over
    assert ejections.eject("a") == EJECT_SECONDS


def test_when_every_endpoint_is_ejected_none_is():
    ejections = Ejections(clock=Clock())
    ejections.eject("a")
    ejections.eject("b")
    assert ejections.ejected(["a", "b"]) == frozenset()
    assert ejections.ejected(["a", "b", "c"]) == {"a", "b"}


@pytest.mark.parametrize(
    ("error", "ejected"),
    [
        pytest.param(ConnectFailed("refused, or timed out"), True, id="a-connect-failure-ejects"),
        pytest.param(UpstreamTimeout("slow"), False, id="a-slow-answer-does-not"),
        pytest.param(UpstreamBroke("cut"), False, id="a-cut-answer-does-not"),
    ],
)
def test_a_connect_failure_ejects_the_endpoint_for_this_gateway_at_once(error, ejected):
    source = Routes(
        stored(deployment("chat", 2, LLAMA_CPU)),
        [
            endpoint("chat-0", "chat", "cpu", "10.0.0.1", 8001),
            endpoint("chat-1", "chat", "cpu", "10.0.0.2", 8002),
        ],
    )
    table = EndpointTable(source)
    asyncio.run(table.refresh())
    table.failed("chat-0", error)
    assert table.ejected("chat") == ({"chat-0"} if ejected else frozenset())
    assert table.ejected("no-such-model") == frozenset()
    # A replica that leaves the routes is forgotten (names are never reused).
    del source.endpoints[0]
    asyncio.run(table.refresh())
    assert "chat-0" not in table.ejections.until


@dataclass
class SlowRoutes(Routes):
    """Routes whose deployment list takes a moment to read (until ``released``) and is counted."""

    released: threading.Event = field(default_factory=threading.Event)
    reads: int = 0
    fail: bool = False

    def list_deployments(self) -> list[StoredDeployment]:
        self.reads += 1
        snapshot = list(self.deployments)  # what the store held when the read began
        self.released.wait(10)
        if self.fail:
            raise StoreError("state store: listing deployments failed: OperationalError: disk I/O error")
        return snapshot


def test_a_miss_reads_again_and_misses_at_the_same_time_share_the_reads():
    async def main() -> None:
        source = SlowRoutes()
        table = EndpointTable(source, gate=ChangeGate(pace=0.0))  # no rest after these slow reads
        source.released.set()
        await table.refresh()
        source.released.clear()
        source.reads = 0
        # Applied after the table's read: 20 requests for it at once.
        source.deployments = stored(deployment("chat", 1, LLAMA_CPU))
        lookups = [asyncio.ensure_future(table.lookup("chat")) for _ in range(20)]
        await asyncio.sleep(0.05)
        source.released.set()
        routes = await asyncio.gather(*lookups)
        assert all(r is not None and r.deployment == "chat" for r in routes)
        assert source.reads == 1
        # 20 misses of a model nobody applied: the first reads, the others wait for that read and
        # then share one more (it may have begun before what they ask for was applied).
        source.reads = 0
        assert await asyncio.gather(*(table.lookup("ghost") for _ in range(20))) == [None] * 20
        assert source.reads == 2

    asyncio.run(main())


def test_a_refresh_that_began_before_the_apply_is_followed_by_a_read_of_the_misses_own():
    async def main() -> None:
        source = SlowRoutes()
        table = EndpointTable(source, gate=ChangeGate(pace=0.0))  # no rest after these slow reads
        periodic = asyncio.ensure_future(table.refresh())  # reading, with no deployment yet
        await asyncio.sleep(0.05)
        source.deployments = stored(deployment("chat", 1, LLAMA_CPU))  # applied meanwhile
        lookup = asyncio.ensure_future(table.lookup("chat"))
        await asyncio.sleep(0.05)
        source.released.set()
        await periodic
        route = await lookup
        assert route is not None and route.deployment == "chat"
        assert source.reads == 2

    asyncio.run(main())


def test_a_miss_the_store_cannot_answer_stays_a_miss_and_a_cancelled_caller_leaves_the_read_to_finish(caplog):
    async def main() -> None:
        source = SlowRoutes(stored(deployment("chat", 1, LLAMA_CPU)), fail=True)
        source.released.set()
        table = EndpointTable(source)
        assert await table.lookup("chat") is None
        assert "reading the routes for 'chat' failed" in caplog.text and "disk I/O error" in caplog.text
        source.fail = False
        source.released.clear()
        gone = asyncio.ensure_future(table.lookup("chat"))
        await asyncio.sleep(0.05)
        gone.cancel()  # the client went away while the read ran
        await asyncio.sleep(0)
        assert table._refreshing is not None and not table._refreshing.done()
        source.released.set()
        assert await table.lookup("chat") is not None
        await table.stop()

    asyncio.run(main())


# --- Endpoints (servers fleetserve did not start) ------------------------------------------------


def upstream(
    name: str, models: object, state: EndpointState = EndpointState.READY, **fields: object
) -> StoredEndpoint:
    spec = Endpoint.model_validate(
        {"name": name, "url": f"https://{name}.example.com/api", "models": models, **fields}
    )
    return StoredEndpoint(spec, state)


def test_a_ready_endpoint_a_deployment_lists_is_routed_beside_its_replicas_with_its_key_and_names(tmp_path):
    write_secret(tmp_path / "box.key", "sk-box-1\n")
    source = Routes(
        stored(deployment("chat", 1, LLAMA_CPU, endpoints=["box", "down", "cold"])),
        [endpoint("chat-0", "chat", "cpu", "10.0.0.1", 8001)],
        [
            upstream("box", {"chat": "llama3.2:3b"}, keyFile="box.key", weight=3),
            upstream("down", ["chat"], EndpointState.NOT_READY),
            upstream("cold", ["chat"], EndpointState.UNKNOWN),  # not checked yet
        ],
    )
    route = EndpointTable(source, keys=EndpointKeys(tmp_path)).load()["chat"]
    assert [(e.replica, e.url, e.weight, e.upstream_model) for e in route.endpoints] == [
        ("chat-0", "http://10.0.0.1:8001", 1.0, None),
        ("endpoint/box", "https://box.example.com/api", 3.0, "llama3.2:3b"),
    ]
    assert route.endpoints[1].engine_key == "sk-box-1" and "sk-box-1" not in repr(route.endpoints[1])
    assert route.engines["endpoint/box"] == "vllm"
    assert {e.value for e in route.engine_kinds} == {"llama.cpp", "vllm"}


def test_models_no_deployment_serves_are_served_by_the_endpoints_alone_and_others_are_not():
    source = Routes(
        stored(deployment("chat", 1, LLAMA_CPU, endpoints=["a"])),
        [],
        [
            upstream("a", ["chat", "embed"]),
            upstream("b", {"embed": "bge-m3", "code": "qwen"}, engine="llama.cpp"),
            upstream("c", ["rare"], EndpointState.NOT_READY),
        ],
    )
    routes = EndpointTable(source).load()
    assert sorted(routes) == ["chat", "code", "embed", "rare"]
    assert [(e.replica, e.upstream_model) for e in routes["embed"].endpoints] == [
        ("endpoint/a", "embed"),
        ("endpoint/b", "bge-m3"),
    ]
    assert [e.replica for e in routes["chat"].endpoints] == ["endpoint/a"]
    assert {k.value for k in routes["embed"].engine_kinds} == {"vllm", "llama.cpp"}
    assert routes["rare"].endpoints == () and routes["rare"].scales_from_zero is False


def test_an_endpoint_whose_key_this_gateway_cannot_read_is_left_out_of_its_routes(tmp_path, caplog):
    (tmp_path / "other").write_text("not for endpoints")
    (tmp_path / "link.key").symlink_to(tmp_path / "other")
    source = Routes(
        [],
        [],
        [upstream("gone", ["m"], keyFile="missing.key"), upstream("link", ["n"], keyFile="link.key")],
    )
    routes = EndpointTable(source, keys=EndpointKeys(tmp_path)).load()
    assert routes["m"].endpoints == () and routes["n"].endpoints == ()
    assert "endpoint gone is not routed from this gateway" in caplog.text
    assert "not for endpoints" not in caplog.text
