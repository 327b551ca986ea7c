"""YAML loading: every problem names the file, the document, the field and what would be valid."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve.errors import ConfigError
from fleetserve.spec.loader import load_files, load_text

NODE = "kind: Node\nname: n1\ncpu: {cores: 8, memory: 32GiB}\n"


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_text(text, "fleet.yaml")
    return [str(p) for p in info.value.problems]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            NODE + "gpu: []\n",
            "fleet.yaml document 1 (Node n1): gpu: unknown field; valid fields of Node are: address, cordon, cpu,",
            id="unknown-field-lists-valid-fields",
        ),
        pytest.param(
            "kind: Nodes\nname: x\n",
            "fleet.yaml document 1: kind: got 'Nodes'; valid kinds: DeviceClass, Fabric, Node, Model, "
            "Deployment, Replica",
            id="unknown-kind",
        ),
        pytest.param(
            "kind: DeviceClass\nname: c\ndriver: gpu.nvidia.com\nmemory: 80 gigs\n",
            "fleet.yaml document 1 (DeviceClass c): memory: '80 gigs' is not a byte quantity",
            id="bad-quantity",
        ),
        pytest.param(
            "kind: Deployment\nname: d\nmodel: m\nprofiles: [{name: p, engine: vlm}]\n",
            "fleet.yaml document 1 (Deployment d): profiles[0].engine: got 'vlm'; valid values: 'vllm' or 'llama.cpp'",
            id="bad-enum-names-values",
        ),
        pytest.param(
            "kind: Deployment\nname: d\nmodel: m\nreplicas: {min: 3, max: 1}\nprofiles: [{name: p, engine: vllm}]\n",
            "fleet.yaml document 1 (Deployment d): replicas: replicas.min (3) must not exceed replicas.max (1)",
            id="replica-range",
        ),
        pytest.param(
            "kind: Node\nname: Bad_Name\ncpu: {cores: 1, memory: 1GiB}\n",
            "fleet.yaml document 1 (Node Bad_Name): name: 'Bad_Name' is not a valid name",
            id="bad-name",
        ),
        pytest.param(
            NODE + "gpus: [{class: c, count: 2}]\nnvlinkDomains: [[0, 5]]\n",
            "nvlinkDomains names device indices the node does not have: [5]",
            id="nvlink-domain-unknown-device",
        ),
        pytest.param(
            "kind: Node\nname: n\ncpu: {cores: 1, memory: ~}\n",
            "fleet.yaml document 1 (Node n): cpu.memory: expected a byte quantity such as 80GiB or a number of bytes, not NoneType",
            id="null-quantity",
        ),
        pytest.param(
            "kind: Node\nname: n\ncpu: {cores: 1, memory: .inf}\n",
            "cpu.memory: a byte quantity must be a finite number",
            id="infinite-quantity",
        ),
        pytest.param(
            "kind: Node\nname: [unclosed\n", "fleet.yaml:2:7: not valid YAML", id="yaml-syntax-has-line"
        ),
    ],
)
def test_a_bad_document_is_reported_with_file_document_field_and_fix(text, expected):
    assert any(expected in p for p in problems(text)), problems(text)


def test_every_problem_in_every_document_is_reported_at_once():
    text = NODE + "extra: 1\n---\nkind: Fabric\nname: f\ntype: ethernet\n---\n" + NODE.replace("n1", "n2")
    found = problems(text)
    assert len(found) == 2
    assert found[0].startswith("fleet.yaml document 1 (Node n1): extra")
    assert found[1].startswith("fleet.yaml document 2 (Fabric f): type: got 'ethernet'; valid values: ")


def test_gpus_shorthand_expands_to_numbered_devices_after_the_listed_ones():
    docs = load_text(
        NODE + "devices: [{index: 0, class: a, health: {eccUncorrected: 1}}]\ngpus: [{class: b, count: 2}]\n"
    )
    node = docs.nodes[0]
    assert [(d.index, d.device_class, d.health.healthy) for d in node.devices] == [
        (0, "a", False),
        (1, "b", True),
        (2, "b", True),
    ]


def test_multiple_files_merge_and_an_unreadable_file_is_named(tmp_path: Path):
    a = tmp_path / "a.yaml"
    a.write_text(NODE)
    b = tmp_path / "b.yaml"
    b.write_text("kind: Fabric\nname: ib\n")
    docs = load_files([a, b])
    assert [n.name for n in docs.nodes] == ["n1"] and [f.name for f in docs.fabrics] == ["ib"]
    with pytest.raises(ConfigError) as info:
        load_files([a, tmp_path / "missing.yaml"])
    assert "missing.yaml: cannot read file" in str(info.value)


def test_the_examples_load():
    root = Path(__file__).resolve().parents[2] / "examples"
    for name in ("homelab", "datacenter"):
        docs = load_files([root / name / "fleet.yaml", root / name / "deployments.yaml"])
        assert docs.nodes and docs.deployments
