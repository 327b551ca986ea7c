"""The inventory interface: what every store (in memory here, SQL later) must do, and its rules.

- Registration is idempotent. Re-registering updates hardware facts and bumps the node's epoch
  (fencing: a returning agent learns which of its replicas moved away) but never clears an
  operator's cordon: a cordon is usually there because something is wrong with the node.
- A device with an uncorrected ECC fault, or a process fleetserve did not start, is not free.
- A replica is allocated and released whole — every shard on every node at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from fleetserve.errors import AllocationConflict
from fleetserve.inventory.approval import HardwareHeld
from fleetserve.modelfacts import ModelFacts
from fleetserve.snapshot import ClusterSnapshot
from fleetserve.spec.resources import DeviceClass, Fabric, Node, NodeState, Replica


@dataclass(frozen=True)
class Registration:
    """The outcome of registering a node: the node as stored, its epoch, whether it was new, and
    the hardware claim held for an operator's approval (``inventory.approval``; None: none)."""

    node: Node
    epoch: int
    created: bool
    held: HardwareHeld | None = None


class Inventory(Protocol):
    """Nodes, device classes, fabrics and whole-replica allocations."""

    def put_class(self, cls: DeviceClass) -> None:
        """Create or replace a device class."""

    def put_fabric(self, fabric: Fabric) -> None:
        """Create or replace a fabric."""

    def register(self, node: Node) -> Registration:
        """Create or update a node from its agent's hardware facts; never clears a cordon."""

    def get_node(self, name: str) -> Node:
        """The node named ``name``; raises UnknownNode."""

    def nodes(self) -> list[Node]:
        """Every node, by name."""

    def cordon(self, name: str, reason: str, by: str = "operator") -> Node:
        """Keep new replicas off a node, saying why."""

    def uncordon(self, name: str) -> Node:
        """Lift a cordon."""

    def set_state(self, name: str, state: NodeState) -> Node:
        """Record whether the node's agent is heard from."""

    def allocate(self, replica: Replica) -> None:
        """Take every shard of a replica at once; raise AllocationConflict and take nothing if
        any device is allocated, unhealthy or missing, or any node lacks the CPU or memory."""

    def allocate_all(self, replicas: Sequence[Replica]) -> list[AllocationConflict | None]:
        """Take each replica whole, in order, as ``allocate`` one after another would (each checked
        against what the ones before it took); per replica, None or the conflict that refused it.
        A store may take them in fewer transactions."""

    def release(self, name: str) -> Replica:
        """Give back every shard of a replica at once; raises UnknownReplica."""

    def replicas(self) -> list[Replica]:
        """Every allocated replica."""

    def snapshot(self, models: Mapping[str, ModelFacts] | None = None) -> ClusterSnapshot:
        """An immutable view for one placement or reconcile cycle."""


def allocate_each(
    allocate: Callable[[Replica], object], replicas: Sequence[Replica]
) -> list[AllocationConflict | None]:
    """``allocate`` each replica on its own, in order: per replica, None or the conflict it met."""
    out: list[AllocationConflict | None] = []
    for replica in replicas:
        try:
            allocate(replica)
            out.append(None)
        except AllocationConflict as exc:
            out.append(exc)
    return out
