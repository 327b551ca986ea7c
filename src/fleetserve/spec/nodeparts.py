"""The parts a ``Node`` document is made of: its devices (or the ``gpus`` shorthand for many
alike) and their health, its HCAs, its CPU capacity, an operator's cordon, and the engine builds
its agent found (fingerprints).
"""

from __future__ import annotations

from pydantic import Field

from fleetserve.drivers import RuntimeVariant
from fleetserve.engines.spec import EngineKind
from fleetserve.spec.base import MAX_CORES, Bytes, Name, Spec

# The caps on what one agent may say about its engines.
MAX_ENGINES = 16
MAX_ENGINE_DEVICES = 256
# Free text from a binary may hold anything but NUL.
_TEXT = r"^[^\x00]*$"


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


class EngineDevice(Spec):
    """A device an engine build lists as its own (``llama-server --list-devices``): its name
    there (``CUDA0``), the variant computing on it (None: a backend fleetserve has no variant
    for, such as Metal) and the binary's own description of it."""

    name: str = Field(min_length=1, max_length=64, pattern=_TEXT)
    variant: RuntimeVariant | None = None
    description: str = Field(default="", max_length=253, pattern=_TEXT)


class EngineFingerprint(Spec):
    """One engine binary on a node as it answered its agent: the engine, its version, the runtime
    variants its build runs on this node, and the devices it sees."""

    engine: EngineKind
    version: str = Field(default="", max_length=128, pattern=_TEXT)
    variants: tuple[RuntimeVariant, ...] = Field(default=(), max_length=len(RuntimeVariant))
    devices: tuple[EngineDevice, ...] = Field(default=(), max_length=MAX_ENGINE_DEVICES)
    # Where the agent found it (an override, PATH or the build installed with fleetserve).
    binary: str = Field(default="", max_length=4096, pattern=_TEXT)
