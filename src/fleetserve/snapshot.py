"""The immutable view of the cluster one placement or reconcile cycle decides from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from fleetserve.drivers import Driver, parse_driver
from fleetserve.modelfacts import ModelFacts
from fleetserve.spec.resources import DeviceClass, Fabric, Node, NodeState, Replica


def _empty() -> Mapping[str, object]:
    return MappingProxyType({})


@dataclass(frozen=True)
class ClusterSnapshot:
    """Classes, nodes, fabrics, allocated replicas and model facts, frozen for one cycle."""

    classes: Mapping[str, DeviceClass]
    nodes: tuple[Node, ...]
    fabrics: Mapping[str, Fabric] = field(default_factory=_empty)  # type: ignore[arg-type]
    replicas: tuple[Replica, ...] = ()
    models: Mapping[str, ModelFacts] = field(default_factory=_empty)  # type: ignore[arg-type]

    def node_drivers(self, node: Node) -> frozenset[Driver]:
        """The known drivers of a node's devices; a node with no accelerator is a CPU node."""
        out = set()
        for device in node.devices:
            cls = self.classes.get(device.device_class)
            driver = parse_driver(cls.driver) if cls else None
            if driver is not None:
                out.add(driver)
        return frozenset(out) if out else frozenset({Driver.CPU})

    def served_drivers(self) -> frozenset[Driver]:
        """Drivers some node that is not Lost can serve (CPU included wherever a CPU node is)."""
        out: set[Driver] = set()
        for node in self.nodes:
            if node.state is not NodeState.LOST:
                out |= self.node_drivers(node)
        return frozenset(out)
