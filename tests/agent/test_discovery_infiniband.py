"""InfiniBand/RoCE discovery from a recorded sysfs tree, and HCAs mapped onto fabrics."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fleetserve.agent.discovery.infiniband import InfinibandDiscoverer
from fleetserve.inventory.hardware import Discovery, HcaFacts, HostFacts
from fleetserve.inventory.matching import FabricMap, UnmatchedReason, to_node
from fleetserve.spec.nodeparts import Hca

TREE = Path(__file__).parent.parent / "fixtures/discovery/sysfs/linux_infiniband_3_mlx5"
HOST = HostFacts(
    "ib-01", physical_cores=64, logical_cpus=128, numa_nodes=2, memory_total=2**39, memory_available=2**38
)
DEFAULT_PREFIX = "fe80:0000:0000:0000"


def hcas() -> tuple[HcaFacts, ...]:
    found = InfinibandDiscoverer(TREE).discover()
    assert found.problems == ()
    return found.hcas


@pytest.mark.parametrize(
    ("position", "name", "port_guid", "link_layer", "state"),
    [
        (0, "mlx5_0", "1070:fd03:008e:b580", "InfiniBand", "ACTIVE"),
        (1, "mlx5_1", "1070:fd03:008e:a7a4", "InfiniBand", "DOWN"),
        (2, "mlx5_2", "0ac0:ebff:fef1:1f0c", "Ethernet", "ACTIVE"),
    ],
)
def test_each_recorded_hca_is_found_with_port_guid_subnet_prefix_link_layer_and_state(
    position: int, name: str, port_guid: str, link_layer: str, state: str
) -> None:
    hca = hcas()[position]
    assert (hca.name, hca.port_guids, hca.subnet_prefixes) == (name, (port_guid,), (DEFAULT_PREFIX,))
    assert (hca.link_layer, hca.state) == (link_layer, state)


def attach(fabric_map: FabricMap) -> tuple[tuple[Hca, ...], list[tuple[str, UnmatchedReason]]]:
    node, unmatched = to_node(Discovery(HOST, (), hcas(), ()), {}, fabric_map, "ib-01", {}, frozenset())
    return node.hcas, [(u.subject, u.reason) for u in unmatched]


def test_two_hcas_are_mapped_onto_fabrics_by_port_guid_and_the_unmapped_one_is_reported() -> None:
    fabric_map = FabricMap.from_dict(
        {"portGuids": {"0x1070fd03008eb580": "ib-hdr", "0ac0:ebff:fef1:1f0c": "roce-storage"}}
    )
    attached, unmatched = attach(fabric_map)
    assert attached == (Hca(name="mlx5_0", fabric="ib-hdr"), Hca(name="mlx5_2", fabric="roce-storage"))
    assert unmatched == [("HCA mlx5_1", UnmatchedReason.NO_FABRIC)]


def test_a_port_guid_mapping_wins_over_a_subnet_prefix_and_a_down_link_is_not_attached() -> None:
    fabric_map = FabricMap.from_dict(
        {"subnetPrefixes": {"fe80::/64": "ib-hdr"}, "portGuids": {"0ac0:ebff:fef1:1f0c": "roce-storage"}}
    )
    attached, unmatched = attach(fabric_map)
    assert attached == (Hca(name="mlx5_0", fabric="ib-hdr"), Hca(name="mlx5_2", fabric="roce-storage"))
    assert unmatched == [("HCA mlx5_1", UnmatchedReason.HCA_NOT_ACTIVE)]


def test_the_unmapped_hca_report_names_its_port_guid_and_subnet_prefix() -> None:
    _, unmatched = to_node(Discovery(HOST, (), hcas(), ()), {}, FabricMap(), "ib-01", {}, frozenset())
    assert str(unmatched[1]) == (
        "HCA mlx5_1: no fabric is mapped to port GUID 1070:fd03:008e:a7a4 / subnet prefix fe80:0000:0000:0000; "
        "it is not attached"
    )


def test_a_machine_without_rdma_has_no_hca_and_no_problem(tmp_path: Path) -> None:
    found = InfinibandDiscoverer(tmp_path).discover()
    assert (found.hcas, found.problems) == ((), ())


@pytest.mark.parametrize(
    ("gid", "problem"),
    [
        pytest.param(
            "0000:0000:0000:0000:0000:0000:0000:0000",
            "infiniband: mlx5_1 port 1: no default GID (gids/0 reads 0000:0000:0000:0000:0000:0000:0000:0000); "
            "the port is left out",
            id="an-all-zero-gid",
        ),
        pytest.param(
            "garbage",
            "infiniband: mlx5_1 port 1: no default GID (gids/0 reads garbage); the port is left out",
            id="an-unparsable-gid",
        ),
    ],
)
def test_a_port_without_a_usable_gid_is_left_out_and_reported(tmp_path: Path, gid: str, problem: str) -> None:
    root = tmp_path / "ib"
    shutil.copytree(TREE, root)
    (root / "sys/class/infiniband/mlx5_1/ports/1/gids/0").write_text(gid + "\n")
    found = InfinibandDiscoverer(root).discover()
    assert [h.name for h in found.hcas] == ["mlx5_0", "mlx5_2"]
    assert found.problems == (problem, "infiniband: mlx5_1: no port with a GID; the HCA is not reported")


def test_a_two_port_hca_reports_active_when_its_second_port_is_the_active_one(tmp_path: Path) -> None:
    root = tmp_path / "ib"
    shutil.copytree(TREE, root)
    port2 = root / "sys/class/infiniband/mlx5_1/ports/2"
    shutil.copytree(root / "sys/class/infiniband/mlx5_0/ports/1", port2)
    (hca,) = [h for h in InfinibandDiscoverer(root).discover().hcas if h.name == "mlx5_1"]
    assert (hca.state, hca.link_layer) == ("ACTIVE", "InfiniBand")
    assert hca.port_guids == ("1070:fd03:008e:a7a4", "1070:fd03:008e:b580")
