"""Placement on Apple Silicon: replicas are sized against the unified memory macOS lets the GPU
wire (not the RAM), and the host memory of the same Mac is only what the GPU cannot take."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetserve.agent.discovery.macos import MacDiscoverer
from fleetserve.drivers import Driver, RuntimeVariant
from fleetserve.fleet import snapshot_from
from fleetserve.inventory.hardware import Discovery, HostFacts
from fleetserve.inventory.matching import FabricMap, to_node
from fleetserve.placement.placer import DeploymentDecision, plan
from fleetserve.placement.report import Reason
from fleetserve.spec.loader import Documents, load_files
from fleetserve.spec.resources import Deployment, DeviceClass, Model, Node
from fleetserve.validation import resolve_profile

ROOT = Path(__file__).resolve().parents[2]
M4_MAX = ROOT / "tests/fixtures/discovery/macos/darwin_apple_1_m4_max_128g.json"
GiB = 1 << 30

# 75 GB of Q8_0 weights; 320 KiB of KV cache per token (80 layers x 8 KV heads x 128 x 2 x f16).
MODEL = Model.model_validate(
    {
        "name": "llama-3.3-70b",
        "source": "hf://bartowski/Llama-3.3-70B-Instruct-GGUF/Llama-3.3-70B-Instruct-Q8_0.gguf",
        "format": "gguf",
        "size": "75GB",
        "architecture": {"layers": 80, "kvHeads": 8, "headDim": 128, "contextLength": 131072},
    }
)
M4_MAX_CLASS = DeviceClass.model_validate(
    {
        "name": "apple-m4-max",
        "driver": "gpu.apple.com",
        "memory": "96GiB",
        "match": {"productName": "Apple M4 Max"},
    }
)


def m4_max_node() -> Node:
    """The M4 Max as its agent registers it: discovery replayed with macOS's default wired limit."""
    commands = dict(json.loads(M4_MAX.read_text())["commands"])
    commands.pop("sysctl -n iogpu.wired_limit_mb")  # the default: 3/4 of 128 GiB
    gpus = MacDiscoverer(lambda argv: commands.get(" ".join(argv)), system="Darwin").discover().gpus
    host = HostFacts(
        "m4",
        physical_cores=16,
        logical_cpus=16,
        numa_nodes=1,
        memory_total=128 * GiB,
        memory_available=100 * GiB,
    )
    node, unmatched = to_node(
        Discovery(host, gpus, (), ()), {M4_MAX_CLASS.name: M4_MAX_CLASS}, FabricMap(), "m4", {}, frozenset()
    )
    assert unmatched == ()
    return node


def deployment(*profiles: dict[str, object]) -> Deployment:
    return Deployment.model_validate(
        {"name": "llama-70b", "model": MODEL.name, "replicas": 1, "profiles": list(profiles)}
    )


def decide(dep: Deployment, node: Node) -> DeploymentDecision:
    docs = Documents(classes=[M4_MAX_CLASS], nodes=[node], models=[MODEL], deployments=[dep])
    [decision] = plan([dep], snapshot_from(docs))
    return decision


def test_a_32k_context_fits_the_96_gib_the_m4_max_gpu_may_wire() -> None:
    # 69.8 GiB of weights + 10 GiB of KV cache + 1 GiB of runtime: 81 GiB of 96.
    decision = decide(
        deployment({"name": "metal", "engine": "llama.cpp", "deviceClass": "apple-m4-max", "context": 32768}),
        m4_max_node(),
    )
    (placed,) = decision.placed
    (shard,) = placed.replica.shards
    assert (shard.node, shard.devices, placed.replica.device_class) == ("m4", (0,), "apple-m4-max")


def test_a_128k_context_needs_more_than_the_gpu_may_wire_though_the_mac_has_128_gib() -> None:
    # 69.8 + 40 + 1 = 110.8 GiB: under the 128 GiB of RAM, over the 96 GiB macOS gives the GPU.
    decision = decide(
        deployment(
            {"name": "metal", "engine": "llama.cpp", "deviceClass": "apple-m4-max", "context": 131072}
        ),
        m4_max_node(),
    )
    (unplaced,) = decision.unplaced
    (report,) = unplaced.reports
    assert report.counts() == {(Reason.DEVICE_MEMORY_TOO_SMALL, None): 1}


@pytest.mark.parametrize(
    ("host_claim", "fits"),
    [pytest.param("24GiB", True, id="24GiB-of-the-32-left"), pytest.param("40GiB", False, id="40GiB-over")],
)
def test_host_memory_claimed_beside_the_gpu_is_only_what_the_gpu_cannot_take(
    host_claim: str, fits: bool
) -> None:
    node = m4_max_node()
    assert node.cpu.memory == 32 * GiB  # 128 GiB of RAM less the GPU's 96: no byte counted twice
    decision = decide(
        deployment(
            {
                "name": "metal",
                "engine": "llama.cpp",
                "deviceClass": "apple-m4-max",
                "context": 32768,
                "cpu": {"cores": 8, "memory": host_claim},
            }
        ),
        node,
    )
    if fits:
        assert len(decision.placed) == 1
    else:
        (unplaced,) = decision.unplaced
        assert unplaced.reports[0].counts() == {(Reason.INSUFFICIENT_MEMORY, None): 1}


def test_the_mac_studio_example_places_the_70b_model_on_metal() -> None:
    example = ROOT / "examples/mac-studio"
    docs = load_files([example / "fleet.yaml", example / "deployments.yaml"])
    [decision] = plan(docs.deployments, snapshot_from(docs))
    (placed,) = decision.placed
    assert placed.replica.profile == "mac-metal"
    assert [s.node for s in placed.replica.shards] == ["mac-studio"]
    profile = docs.deployments[0].profiles[0]
    assert profile.runtime is None  # metal is the Apple row's default llama.cpp variant
    resolved = resolve_profile(profile, {c.name: c for c in docs.classes})
    assert (resolved.driver, resolved.variant) == (Driver.APPLE, RuntimeVariant.METAL)
