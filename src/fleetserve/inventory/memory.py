"""An in-memory inventory: the reference implementation of ``Inventory`` (and the tests' fake)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

from pydantic import ValidationError as PydanticValidationError

from fleetserve.errors import AllocationConflict, ConfigError, Problem, UnknownNode, UnknownReplica
from fleetserve.inventory.base import Registration, allocate_each
from fleetserve.modelfacts import ModelFacts
from fleetserve.placement.state import WorkingState
from fleetserve.snapshot import ClusterSnapshot, replica_ordinal
from fleetserve.spec.nodeparts import Cordon
from fleetserve.spec.resources import DeviceClass, Fabric, Node, NodeState, Replica


class InMemoryInventory:
    """Holds the inventory in dicts; every operation is all-or-nothing."""

    def __init__(self) -> None:
        self._classes: dict[str, DeviceClass] = {}
        self._fabrics: dict[str, Fabric] = {}
        self._nodes: dict[str, Node] = {}
        self._epochs: dict[str, int] = {}
        self._replicas: dict[str, Replica] = {}
        self._next_ordinals: dict[str, int] = {}

    def put_class(self, cls: DeviceClass) -> None:
        self._classes[cls.name] = cls

    def put_fabric(self, fabric: Fabric) -> None:
        self._fabrics[fabric.name] = fabric

    def register(self, node: Node) -> Registration:
        existing = self._nodes.get(node.name)
        # Hardware facts come from the agent; the cordon is the operator's and survives.
        cordon = existing.cordon if existing is not None else node.cordon
        stored = node.model_copy(update={"cordon": cordon, "state": NodeState.READY})
        self._nodes[node.name] = stored
        self._epochs[node.name] = self._epochs.get(node.name, 0) + 1
        return Registration(stored, self._epochs[node.name], existing is None)

    def get_node(self, name: str) -> Node:
        try:
            return self._nodes[name]
        except KeyError:
            raise UnknownNode(f"no node named {name!r} is registered") from None

    def nodes(self) -> list[Node]:
        return [self._nodes[n] for n in sorted(self._nodes)]

    def epoch(self, name: str) -> int:
        """The node's registration epoch (0 if never registered)."""
        return self._epochs.get(name, 0)

    def cordon(self, name: str, reason: str, by: str = "operator") -> Node:
        try:
            cordon = Cordon(reason=reason, by=by)
        except PydanticValidationError as exc:
            raise ConfigError(
                [Problem(f"Node {name}", "cordon.reason", "give a reason for the cordon")]
            ) from exc
        node = self.get_node(name).model_copy(update={"cordon": cordon})
        self._nodes[name] = node
        return node

    def uncordon(self, name: str) -> Node:
        node = self.get_node(name).model_copy(update={"cordon": None})
        self._nodes[name] = node
        return node

    def set_state(self, name: str, state: NodeState) -> Node:
        node = self.get_node(name).model_copy(update={"state": state})
        self._nodes[name] = node
        return node

    def allocate(self, replica: Replica) -> None:
        # Check against the current free capacity; raises AllocationConflict before any change.
        WorkingState(self.snapshot()).check(replica)
        self._replicas[replica.name] = replica
        ordinal = replica_ordinal(replica.deployment, replica.name)
        if ordinal is not None:
            self._next_ordinals[replica.deployment] = max(
                self._next_ordinals.get(replica.deployment, 0), ordinal + 1
            )

    def allocate_all(self, replicas: Sequence[Replica]) -> list[AllocationConflict | None]:
        return allocate_each(self.allocate, replicas)

    def release(self, name: str) -> Replica:
        try:
            return self._replicas.pop(name)
        except KeyError:
            raise UnknownReplica(f"no replica named {name!r} is allocated") from None

    def replicas(self) -> list[Replica]:
        return [self._replicas[n] for n in sorted(self._replicas)]

    def snapshot(self, models: Mapping[str, ModelFacts] | None = None) -> ClusterSnapshot:
        return ClusterSnapshot(
            classes=MappingProxyType(dict(self._classes)),
            nodes=tuple(self.nodes()),
            fabrics=MappingProxyType(dict(self._fabrics)),
            replicas=tuple(self.replicas()),
            models=MappingProxyType(dict(models or {})),
            next_ordinals=MappingProxyType(dict(self._next_ordinals)),
        )
