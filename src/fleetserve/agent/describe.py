"""This machine as a Node: discovery, class matching, the inventory file, the advertised address."""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Mapping
from pathlib import Path

from fleetserve.agent.discovery import default_discoverers, discover
from fleetserve.agent.inventory_file import merge_inventory_file
from fleetserve.agent.runtime import Describe
from fleetserve.inventory.matching import FabricMap, to_node
from fleetserve.spec.resources import DeviceClass, Node

log = logging.getLogger("fleetserve.agent")


def node_name(hostname: str | None = None) -> str:
    """A valid node name from the host name (lower case, other characters as '-')."""
    raw = (hostname or socket.gethostname()).split(".")[0].lower()
    cleaned = re.sub(r"[^a-z0-9-]+", "-", raw).strip("-")[:63]
    return cleaned or "node"


def make_describe(
    name: str,
    labels: Mapping[str, str],
    address: str,
    fabric_map: FabricMap,
    inventory_file: Path | None,
    root: Path = Path("/"),
) -> Describe:
    """A function that discovers this machine afresh each time the agent registers."""

    def describe(
        classes: list[DeviceClass], own_pids: frozenset[int], cached: tuple[str, ...]
    ) -> tuple[Node, list[str]]:
        found = discover(default_discoverers(root))
        node, unmatched = to_node(
            found, {c.name: c for c in classes}, fabric_map, name, labels, own_pids, cached
        )
        if inventory_file is not None:
            node = merge_inventory_file(node, inventory_file)
        node = node.model_copy(update={"address": address})
        for fact in found.facts:
            log.info("discovery: %s", fact)
        problems = list(found.problems) + [
            f"{u.subject}: {u.reason.value}{': ' + u.detail if u.detail else ''}" for u in unmatched
        ]
        return node, problems

    return describe
