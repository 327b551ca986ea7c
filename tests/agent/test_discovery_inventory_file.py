"""``--inventory-file``: declared hardware merged over the discovered node; errors name the file and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve.agent.inventory_file import apply_inventory, merge_inventory_file, parse_inventory
from fleetserve.errors import ConfigError
from fleetserve.spec.nodeparts import CpuCapacity, DeviceHealth, Hca
from fleetserve.spec.resources import Node

DISCOVERED = Node.model_validate(
    {
        "name": "gpu-07",
        "labels": {"zone": "a", "rack": "r1"},
        "cpu": {"cores": 64, "memory": "512GiB", "numaNodes": 2},
        "devices": [
            {"index": 0, "uuid": "GPU-b42dd28e-ffdd-8720-1df0-98bd8cdc05b1", "class": "nvidia-h100-80gb"},
            {"index": 1, "uuid": "GPU-7c3cadbd-17e5-0913-f69b-c618122ea0cd", "class": "nvidia-h100-80gb"},
        ],
        "hcas": [{"name": "mlx5_0", "fabric": "ib-a"}],
        "nvlinkDomains": [[0, 1]],
    }
)


def merge(tmp_path: Path, text: str) -> Node:
    path = tmp_path / "inventory.yaml"
    path.write_text(text)
    return merge_inventory_file(DISCOVERED, path)


def test_declared_hardware_is_merged_over_the_discovered_node(tmp_path: Path) -> None:
    node = merge(
        tmp_path,
        """
kind: Node
name: gpu-07
labels: {rack: r9, owner: ml}
cpu: {cores: 48}
devices:
  - {index: 2, uuid: vk-0, class: amd-gfx1151, health: {eccUncorrected: 1}}
hcas:
  - {name: mlx5_0, fabric: ib-b}
  - {name: mlx5_4, fabric: roce-a}
nvlinkDomains: [[0, 1]]
""",
    )
    assert node.labels == {"zone": "a", "rack": "r9", "owner": "ml"}
    assert node.cpu == CpuCapacity(cores=48, memory=512 * 2**30, numa_nodes=2)
    assert [(d.index, d.device_class) for d in node.devices] == [
        (0, "nvidia-h100-80gb"),
        (1, "nvidia-h100-80gb"),
        (2, "amd-gfx1151"),
    ]
    assert node.devices[2].health == DeviceHealth(ecc_uncorrected=1)
    assert node.hcas == (Hca(name="mlx5_0", fabric="ib-b"), Hca(name="mlx5_4", fabric="roce-a"))
    assert node.nvlink_domains == ((0, 1),)


@pytest.mark.parametrize(
    ("text", "field", "value"),
    [
        pytest.param("kind: Node\n", "nvlink_domains", ((0, 1),), id="an-empty-overlay-changes-nothing"),
        pytest.param(
            "kind: Node\nnvlinkDomains: []\n", "nvlink_domains", (), id="declared-domains-replace-discovered"
        ),
        pytest.param(
            "kind: Node\ncpu: {memory: 1TiB}\n",
            "cpu",
            CpuCapacity(cores=64, memory=2**40, numa_nodes=2),
            id="cpu-field-by-field",
        ),
        pytest.param(
            "kind: Node\nlabels: {zone: b}\n", "labels", {"zone": "b", "rack": "r1"}, id="labels-by-key"
        ),
    ],
)
def test_declared_fields_win_and_fields_left_out_stay_discovered(
    tmp_path: Path, text: str, field: str, value: object
) -> None:
    assert getattr(merge(tmp_path, text), field) == value


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "kind: Node\ndevices: [{index: 3, class: x}, {index: 1, class: nvidia-h100-80gb}]\n",
            "inventory.yaml (Node): devices[1].index: device index 1 is already discovered on this node "
            "(class nvidia-h100-80gb, uuid GPU-7c3cadbd-17e5-0913-f69b-c618122ea0cd); declare devices at indices "
            "discovery left free (taken: [0, 1])",
            id="a-declared-device-at-a-discovered-index",
        ),
        pytest.param(
            "kind: Node\ngpus: [{class: x, count: 2}]\n",
            "inventory.yaml (Node): gpus: unknown field; valid fields of NodeOverlay are: cpu, devices, hcas, kind, "
            "labels, name, nvlinkDomains",
            id="an-unknown-field-lists-the-valid-ones",
        ),
        pytest.param(
            "kind: Node\ncpu: {memory: lots}\n",
            "inventory.yaml (Node): cpu.memory: 'lots' is not a byte quantity",
            id="a-bad-byte-quantity",
        ),
        pytest.param(
            "kind: Node\nnvlinkDomains: [[0, 7]]\n",
            "inventory.yaml (Node): nvlinkDomains names device indices the node does not have: [7]",
            id="an-nvlink-domain-naming-a-missing-device",
        ),
        pytest.param(
            "kind: Node\nname: gpu-08\n",
            "inventory.yaml (Node): name: declares node 'gpu-08', but this agent registers node 'gpu-07'",
            id="another-nodes-file",
        ),
        pytest.param(
            "kind: Model\nname: m\n",
            "inventory.yaml: kind: got 'Model'; an inventory file declares kind: Node",
            id="not-a-node-document",
        ),
        pytest.param(
            "kind: Node\n---\nkind: Node\n",
            "inventory.yaml: an inventory file holds exactly one kind: Node document; found 2",
            id="two-documents",
        ),
        pytest.param(
            "kind: Node\nlabels: {a: [\n",
            "inventory.yaml:3:1: not valid YAML",
            id="not-yaml-names-line-and-column",
        ),
        pytest.param("- kind: Node\n", "inventory.yaml: the document must be a mapping", id="not-a-mapping"),
    ],
)
def test_inventory_errors_name_the_file_and_the_field(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        merge(tmp_path, text)
    assert str(info.value).replace(str(tmp_path) + "/", "").startswith(expected)


def test_an_unreadable_inventory_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        merge_inventory_file(DISCOVERED, tmp_path / "missing.yaml")
    assert str(info.value) == f"{tmp_path / 'missing.yaml'}: cannot read file: No such file or directory"


def test_every_device_index_conflict_is_reported_at_once() -> None:
    overlay = parse_inventory(
        "kind: Node\ndevices: [{index: 0, class: x}, {index: 1, class: x}]\n", "inv.yaml"
    )
    with pytest.raises(ConfigError) as info:
        apply_inventory(DISCOVERED, overlay, "inv.yaml")
    assert [p.field for p in info.value.problems] == ["devices[0].index", "devices[1].index"]
