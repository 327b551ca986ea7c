"""``fleetserve agent --inventory-file``: hardware the agent cannot detect, declared by the operator.

The file holds one partial ``kind: Node`` document; every part is optional::

    kind: Node
    labels: {rack: r12}
    cpu: {cores: 48}                  # only the fields given replace the discovered ones
    devices:                          # added to the discovered devices, at indices discovery left free
      - {index: 8, uuid: GPU-…, class: nvidia-h100-80gb}
    hcas: [{name: mlx5_4, fabric: ib-east}]     # by name: a declared HCA replaces a discovered one
    nvlinkDomains: [[0, 1, 2, 3]]     # replaces the discovered domains when given

Declared values win over discovered ones: labels key by key, CPU field by field, HCAs by name, NVLink
domains as a whole. Devices are only ever added: a declared device at an index discovery already
took is an error naming the index, because two facts about one GPU cannot both be true. Errors name
the file and the field, as the resource loader's do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field
from pydantic import ValidationError as PydanticValidationError

from fleetserve.errors import ConfigError, Problem
from fleetserve.spec.base import MAX_CORES, Bytes, Name, Spec
from fleetserve.spec.loader import problems_from_pydantic
from fleetserve.spec.nodeparts import Device, Hca
from fleetserve.spec.resources import Node


class CpuOverlay(Spec):
    """Declared CPU capacity; the fields left out keep their discovered values."""

    cores: int | None = Field(default=None, ge=1, le=MAX_CORES)
    memory: Bytes | None = None
    numa_nodes: int | None = Field(default=None, ge=1, le=1024)


class NodeOverlay(Spec):
    """A partial Node document: labels, devices, HCAs, NVLink domains and CPU the operator declares."""

    kind: Literal["Node"]
    name: Name | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    devices: tuple[Device, ...] = ()
    hcas: tuple[Hca, ...] = ()
    nvlink_domains: tuple[tuple[int, ...], ...] | None = None
    cpu: CpuOverlay | None = None


def _document(text: str, filename: str) -> Any:
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "context_mark", None) or getattr(exc, "problem_mark", None)
        where = f"{filename}:{mark.line + 1}:{mark.column + 1}" if mark else filename
        what = " ".join(str(x) for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x)
        raise ConfigError([Problem(where, "", f"not valid YAML: {what or exc}")]) from exc
    if len(documents) != 1:
        raise ConfigError(
            [
                Problem(
                    filename,
                    "",
                    f"an inventory file holds exactly one kind: Node document; found {len(documents)}",
                )
            ]
        )
    return documents[0]


def parse_inventory(text: str, filename: str = "<inventory>") -> NodeOverlay:
    """Parse an inventory document; a ConfigError names the file and every bad field."""
    raw = _document(text, filename)
    if not isinstance(raw, dict):
        raise ConfigError([Problem(filename, "", "the document must be a mapping with kind: Node")])
    if raw.get("kind") != "Node":
        raise ConfigError(
            [Problem(filename, "kind", f"got {raw.get('kind')!r}; an inventory file declares kind: Node")]
        )
    try:
        return NodeOverlay.model_validate(raw)
    except PydanticValidationError as exc:
        raise ConfigError(problems_from_pydantic(exc, NodeOverlay, f"{filename} (Node)")) from exc


def load_inventory_file(path: Path | str) -> NodeOverlay:
    """Read and parse ``path``; an unreadable file is a ConfigError naming it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([Problem(str(path), "", f"cannot read file: {exc.strerror or exc}")]) from exc
    return parse_inventory(text, str(path))


def apply_inventory(node: Node, overlay: NodeOverlay, source: str = "<inventory>") -> Node:
    """``node`` as discovered, ``overlay`` merged over it; a conflict is a ConfigError naming ``source``."""
    problems: list[Problem] = []
    where = f"{source} (Node)"
    if overlay.name is not None and overlay.name != node.name:
        problems.append(
            Problem(
                where, "name", f"declares node {overlay.name!r}, but this agent registers node {node.name!r}"
            )
        )
    discovered = {device.index: device for device in node.devices}
    for position, device in enumerate(overlay.devices):
        taken = discovered.get(device.index)
        if taken is not None:
            problems.append(
                Problem(
                    where,
                    f"devices[{position}].index",
                    f"device index {device.index} is already discovered on this node "
                    f"(class {taken.device_class}, uuid {taken.uuid or 'none'}); "
                    "declare devices at indices discovery left free "
                    f"(taken: {sorted(discovered)})",
                )
            )
    if problems:
        raise ConfigError(problems)
    data = node.model_dump(by_alias=True)
    data["labels"] = {**node.labels, **overlay.labels}
    data["devices"] = [d.model_dump(by_alias=True) for d in (*node.devices, *overlay.devices)]
    hcas = {hca.name: hca for hca in node.hcas} | {hca.name: hca for hca in overlay.hcas}
    data["hcas"] = [hca.model_dump(by_alias=True) for hca in hcas.values()]
    if overlay.nvlink_domains is not None:
        data["nvlinkDomains"] = overlay.nvlink_domains
    if overlay.cpu is not None:
        declared = overlay.cpu.model_dump(by_alias=True, exclude_none=True)
        data["cpu"] = {**node.cpu.model_dump(by_alias=True), **declared}
    try:
        return Node.model_validate(data)
    except PydanticValidationError as exc:
        raise ConfigError(problems_from_pydantic(exc, Node, where)) from exc


def merge_inventory_file(node: Node, path: Path | str) -> Node:
    """``node`` with the inventory file at ``path`` merged over it (``--inventory-file``)."""
    return apply_inventory(node, load_inventory_file(path), str(path))
