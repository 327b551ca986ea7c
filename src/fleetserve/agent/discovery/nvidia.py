"""NVIDIA GPUs through NVML (``pynvml``, from the ``nvidia-ml-py`` package).

Only the NVML calls listed in ``NvmlLibrary`` are used, so a recorded replay
(``fleetserve.agent.discovery.nvml_replay``) can stand in for the library in tests. Both raise
``pynvml.NVMLError`` the way the real library does.

NVLink peers: on a board where GPUs are cabled to each other, a link's remote PCI device is the peer
GPU. On HGX/DGX boards every link goes to an NVSwitch instead, and NVML reports the switch's PCI
address (``nvmlDeviceGetNvLinkRemoteDeviceType`` says ``SWITCH``); GPUs that reach the same switch
over active links are peers. Without the remote-type call (older drivers) a remote address that is
one of this machine's GPUs counts as a direct peer and anything else is ignored.

NVML that cannot start is a problem only where an NVIDIA GPU is there to find: the PCI bus (sysfs,
under a configurable root) is asked whether it holds an NVIDIA display controller. Without one, the
missing driver is a fact of a machine with no NVIDIA GPU (a CPU-only node), not a fault of it.
On macOS, which has no NVIDIA driver and no sysfs to ask, it is a fact too (a Mac's GPU is Apple's,
``fleetserve.agent.discovery.macos``).
"""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import pynvml  # type: ignore[import-untyped]

from fleetserve.agent.discovery.base import Findings
from fleetserve.agent.discovery.sysfs import hex_id, normalize_bus_id, read_int, subdirs
from fleetserve.drivers import Driver
from fleetserve.inventory.hardware import GpuFacts

NVML_NVLINK_MAX_LINKS: int = pynvml.NVML_NVLINK_MAX_LINKS
_NVMLError: type[Exception] = pynvml.NVMLError
# What nvmlInit raises when no usable driver is there: NVML's own errors, a missing shared library,
# or a library older than the bindings.
_START_ERRORS: tuple[type[Exception], ...] = (pynvml.NVMLError, pynvml.NVMLLibraryMismatchError, OSError)
# Calls that fail with these codes answer "this GPU has no such thing": no ECC, no such link.
_ABSENT = frozenset(
    {pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT, pynvml.NVML_ERROR_NOT_FOUND}
)
_NO_FUNCTION = frozenset({pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_NOT_SUPPORTED})
_LINK_ACTIVE: int = pynvml.NVML_FEATURE_ENABLED
_REMOTE_GPU: int = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
_REMOTE_SWITCH: int = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
NVIDIA_VENDOR_ID = 0x10DE
# PCI base class 0x03, display controller: VGA (0x0300) and 3D (0x0302, every data-centre GPU).
# An NVSwitch is a bridge (0x0680): a machine with switches and no GPU has no GPU to find.
_DISPLAY_CLASS = 0x03


def nvidia_gpu_on_pci_bus(root: Path | str = "/") -> bool | None:
    """Whether the PCI bus (``sys/bus/pci/devices`` under ``root``) holds an NVIDIA display
    controller; None when the bus cannot be listed (then nobody can tell)."""
    devices = Path(root) / "sys/bus/pci/devices"
    if not devices.is_dir():
        return None
    return any(
        read_int(device / "vendor", 16) == NVIDIA_VENDOR_ID
        and (read_int(device / "class", 16) or 0) >> 16 == _DISPLAY_CLASS
        for device in subdirs(devices)
    )


class MemoryInfo(Protocol):
    """NVML's ``nvmlMemory_t``: sizes in bytes."""

    @property
    def total(self) -> int: ...


class PciInfo(Protocol):
    """NVML's ``nvmlPciInfo_t``: ``busId`` (``00000000:18:00.0``), ``pciDeviceId`` (device << 16 | vendor)."""

    @property
    def busId(self) -> bytes | str: ...

    @property
    def pciDeviceId(self) -> int: ...


class ProcessInfo(Protocol):
    """One entry of NVML's running-process list."""

    @property
    def pid(self) -> int: ...


class NvmlLibrary(Protocol):
    """The NVML calls discovery makes, named as ``pynvml`` names them; errors are ``pynvml.NVMLError``."""

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int, /) -> object: ...
    def nvmlDeviceGetUUID(self, handle: object, /) -> str | bytes: ...
    def nvmlDeviceGetName(self, handle: object, /) -> str | bytes: ...
    def nvmlDeviceGetMemoryInfo(self, handle: object, /) -> MemoryInfo: ...
    def nvmlDeviceGetPciInfo(self, handle: object, /) -> PciInfo: ...
    def nvmlDeviceGetTotalEccErrors(self, handle: object, error_type: int, counter_type: int, /) -> int: ...
    def nvmlDeviceGetComputeRunningProcesses(self, handle: object, /) -> Sequence[ProcessInfo]: ...
    def nvmlDeviceGetNvLinkState(self, handle: object, link: int, /) -> int: ...
    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: object, link: int, /) -> PciInfo: ...
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: object, link: int, /) -> int: ...


class NvidiaDiscoverer:
    """Finds NVIDIA GPUs through NVML; with no driver it reports no GPU and one problem, or one
    fact where the PCI bus under ``root`` shows no NVIDIA GPU either."""

    source = "nvml"

    def __init__(
        self,
        nvml: NvmlLibrary | None = None,
        max_links: int = NVML_NVLINK_MAX_LINKS,
        root: Path | str = "/",
        system: str | None = None,
    ) -> None:
        self.nvml: NvmlLibrary = pynvml if nvml is None else nvml
        self.max_links = max_links
        self.root = Path(root)
        # platform.system(): on Darwin no NVIDIA driver exists to be missing.
        self.system = platform.system() if system is None else system

    def discover(self) -> Findings:
        try:
            self.nvml.nvmlInit()
        except _START_ERRORS as exc:
            if self.system == "Darwin":
                return Findings(
                    facts=(f"nvidia: macOS has no NVIDIA driver (NVML: {exc}); no NVIDIA GPU here",)
                )
            if nvidia_gpu_on_pci_bus(self.root) is False:
                return Findings(
                    facts=(f"nvidia: no NVIDIA GPU on the PCI bus, and no NVIDIA driver (NVML: {exc})",)
                )
            return Findings(
                problems=(
                    f"nvidia: NVML could not start ({exc}): no NVIDIA driver is loaded here, or "
                    "libnvidia-ml.so.1 is not on the library path; no NVIDIA GPU is reported",
                )
            )
        try:
            return self._discover()
        finally:
            with contextlib.suppress(_NVMLError):
                self.nvml.nvmlShutdown()

    def _discover(self) -> Findings:
        problems: list[str] = []
        try:
            count = self.nvml.nvmlDeviceGetCount()
        except _NVMLError as exc:
            return Findings(problems=(f"nvidia: NVML started but cannot count GPUs ({exc})",))
        devices: list[tuple[int, object, str]] = []
        base: dict[int, GpuFacts] = {}
        for index in range(count):
            try:
                handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
                facts = self._read(index, handle, problems)
            except _NVMLError as exc:
                problems.append(f"nvidia: GPU {index}: NVML cannot read it ({exc}); it is not reported")
                continue
            base[index] = facts
            devices.append((index, handle, facts.pci_bus_id))
        peers = self._nvlink_peers(devices, problems)
        gpus = tuple(
            replace(facts, nvlink_peers=tuple(sorted(peers.get(index, set()))))
            for index, facts in base.items()
        )
        return Findings(gpus=gpus, problems=tuple(problems))

    def _read(self, index: int, handle: object, problems: list[str]) -> GpuFacts:
        nvml = self.nvml
        pci = nvml.nvmlDeviceGetPciInfo(handle)
        # pciDeviceId packs the device id in the high 16 bits and the vendor id in the low 16.
        packed = int(pci.pciDeviceId)
        return GpuFacts(
            driver=Driver.NVIDIA,
            index=index,
            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
            name=_text(nvml.nvmlDeviceGetName(handle)),
            memory=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
            pci_vendor_id=hex_id(packed & 0xFFFF),
            pci_device_id=hex_id(packed >> 16),
            gfx_target=None,
            ecc_uncorrected=self._ecc_uncorrected(index, handle, problems),
            compute_pids=self._compute_pids(index, handle, problems),
            render_node=None,
            nvlink_peers=(),
            source=self.source,
            pci_bus_id=normalize_bus_id(pci.busId),
        )

    def _ecc_uncorrected(self, index: int, handle: object, problems: list[str]) -> int:
        try:
            return int(
                self.nvml.nvmlDeviceGetTotalEccErrors(
                    handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
                )
            )
        except _NVMLError as exc:
            if getattr(exc, "value", None) not in _ABSENT:
                problems.append(f"nvidia: GPU {index}: cannot read ECC error counts ({exc}); counted as 0")
            return 0  # a GPU without ECC (most GeForce cards) has no ECC errors to report

    def _compute_pids(self, index: int, handle: object, problems: list[str]) -> tuple[int, ...]:
        try:
            processes = self.nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except _NVMLError as exc:
            if getattr(exc, "value", None) not in _ABSENT:
                problems.append(f"nvidia: GPU {index}: cannot list compute processes ({exc})")
            return ()
        return tuple(sorted({int(p.pid) for p in processes}))

    def _nvlink_peers(
        self, devices: list[tuple[int, object, str]], problems: list[str]
    ) -> dict[int, set[int]]:
        index_of_bus = {bus: index for index, _, bus in devices}
        direct: dict[int, set[int]] = {index: set() for index, _, _ in devices}
        switches: dict[str, set[int]] = {}
        for index, handle, _ in devices:
            for link in range(self.max_links):
                remote = self._active_link(index, handle, link, problems)
                if remote is None:
                    continue
                bus, kind = remote
                if kind == _REMOTE_GPU and bus in index_of_bus:
                    # A link joins both ends, even where only one end could be read.
                    direct[index].add(index_of_bus[bus])
                    direct[index_of_bus[bus]].add(index)
                elif kind == _REMOTE_SWITCH:
                    switches.setdefault(bus, set()).add(index)
        for members in switches.values():
            for index in members:
                direct[index] |= members
        for index in direct:
            direct[index].discard(index)
        return direct

    def _active_link(
        self, index: int, handle: object, link: int, problems: list[str]
    ) -> tuple[str, int] | None:
        """(remote PCI address, remote device type) of an active link, None for an absent or idle one."""
        nvml = self.nvml
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) != _LINK_ACTIVE:
                return None
            bus = normalize_bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
        except _NVMLError as exc:
            if getattr(exc, "value", None) not in _ABSENT:
                problems.append(f"nvidia: GPU {index}: cannot read NVLink {link} ({exc})")
            return None
        try:
            kind = int(nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link))
        except _NVMLError as exc:
            if getattr(exc, "value", None) not in _NO_FUNCTION:
                problems.append(f"nvidia: GPU {index}: cannot tell what NVLink {link} reaches ({exc})")
            kind = -1  # unknown: only a remote address that is one of our GPUs counts (below)
        if kind == -1:
            return (bus, _REMOTE_GPU)
        return (bus, kind)


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
