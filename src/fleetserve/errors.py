"""The exception hierarchy of fleetserve.

    FleetserveError
    ├── ConfigError              a YAML or API document is invalid (names file, document, field)
    ├── ValidationError          a deployment breaks an engine or device rule (names profile, why)
    ├── InventoryError           the inventory refused an operation
    │   ├── UnknownNode          the node is not registered
    │   ├── UnknownReplica       no replica of that identity is allocated
    │   └── AllocationConflict   a device or capacity the replica needs is already taken
    └── StoreError               the state store's database failed (the driver's error is chained)
        └── NotFound             no model, deployment or token of that identity is stored

Expected placement outcomes (a replica that does not fit) are values, not exceptions: see
``fleetserve.placement.report``. Third-party exceptions are converted at the boundary and
chained as ``__cause__``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class FleetserveError(Exception):
    """Base class of every error fleetserve raises on purpose."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an input: where it is, which field, and what would be valid."""

    location: str
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.location}: " if self.location else ""
        field = f"{self.field}: " if self.field else ""
        return f"{where}{field}{self.message}"


class ConfigError(FleetserveError):
    """An input document is invalid; carries every problem found, not just the first."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class ValidationError(ConfigError):
    """A deployment breaks an engine capability or device rule."""


class InventoryError(FleetserveError):
    """The inventory refused an operation."""


class UnknownNode(InventoryError):
    """The named node is not registered."""


class UnknownReplica(InventoryError):
    """No replica of that identity is allocated."""


class AllocationConflict(InventoryError):
    """A device or capacity the replica needs is already taken or does not exist."""


class StoreError(FleetserveError):
    """The state store's database failed or refused an operation; the driver error is the cause."""


class NotFound(StoreError):
    """No stored object (model, deployment, token) of that identity exists."""
