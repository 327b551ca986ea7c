"""The parts a ``Node`` document is made of: its devices (or the ``gpus`` shorthand for many
alike) and their health, its HCAs, its CPU capacity, and an operator's cordon.
"""

from __future__ import annotations

from pydantic import Field

from fleetserve.spec.base import MAX_CORES, Bytes, Name, Spec


class DeviceHealth(Spec):
    """What makes a device not free: uncorrected ECC errors, or processes fleetserve did not start."""

    ecc_uncorrected: int = Field(default=0, ge=0, le=2**31 - 1)
    foreign_processes: tuple[int, ...] = ()

    @property
    def healthy(self) -> bool:
        return self.ecc_uncorrected == 0 and not self.foreign_processes


class Device(Spec):
    """One GPU on a node."""

    index: int = Field(ge=0, le=4095)
    uuid: str = ""
    device_class: str = Field(alias="class")
    health: DeviceHealth = DeviceHealth()


class DeviceGroup(Spec):
    """Shorthand for ``count`` identical healthy devices, numbered after those listed before."""

    device_class: str = Field(alias="class")
    count: int = Field(ge=1, le=1024)


class Hca(Spec):
    """A host channel adapter attaching the node to one fabric."""

    name: str
    fabric: Name


class CpuCapacity(Spec):
    """The node's CPU cores and host memory that replicas may claim."""

    cores: int = Field(ge=1, le=MAX_CORES)
    memory: Bytes
    numa_nodes: int = Field(default=1, ge=1, le=1024)


class Cordon(Spec):
    """An operator's mark that no new replica may land on the node, with the reason."""

    reason: str = Field(min_length=1)
    by: str = "operator"
