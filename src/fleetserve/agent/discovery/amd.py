"""AMD GPUs from sysfs (the ``amdgpu`` driver and its KFD topology), enriched by ``amdsmi`` if present.

Where each fact comes from, under a configurable root (``/`` on a real machine):

- ``sys/class/drm/card<N>/device``: ``vendor`` (``0x1002``), ``device``, ``uevent``
  (``PCI_SLOT_NAME``), ``product_name``, ``unique_id``, ``mem_info_vram_total``/``_used``,
  ``mem_info_gtt_total``/``_used``, ``gpu_busy_percent``, ``ras/umc_err_count`` (``ue: N``) and
  ``drm/renderD<M>`` (the render node ``/dev/dri/renderD<M>``). ``card<N>-DP-1`` style entries are
  display connectors, not devices, and are skipped; so are cards of other vendors.
- ``sys/class/kfd/kfd/topology/nodes/<K>/properties``: ``gfx_target_version`` (``90402`` →
  ``gfx942``, ``110501`` → ``gfx1151``) and ``drm_render_minor``, which ties the node to its card;
  ``nodes/<K>/gpu_id`` ties it to ``sys/class/kfd/kfd/proc/<pid>/vram_<gpu_id>``, the processes using
  the GPU through ROCm.

Numbering: GPUs are numbered in KFD node order, the order HIP and ``ROCR_VISIBLE_DEVICES`` count;
cards without a KFD node (no ROCm support in the kernel) follow, in PCI address order.

GPU-visible memory. A discrete GPU's is its VRAM (``mem_info_vram_total``). An integrated GPU (an
APU such as Strix Halo, Ryzen AI Max+ 395, gfx1151) has no memory of its own: its "VRAM" is a
carve-out the BIOS takes from system RAM at boot (512 MiB to 96 GiB), and it also maps ordinary
system pages through the GTT, up to ``mem_info_gtt_total`` (half the RAM by default, raised with
the kernel's ``ttm.pages_limit``). Both are memory the GPU can address, so an integrated GPU's memory
is reported as carve-out + GTT. The GTT part is the host's own RAM: the host memory discovery
reports (``MemTotal``, which already excludes the carve-out) overlaps it, and a replica on an APU
must not be charged for both. Which GPUs are integrated is told by their gfx target
(``INTEGRATED_GFX_TARGETS``): sysfs has no attribute that says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from fleetserve.agent.discovery.amd_smi import AmdSmiLibrary, enrich_with_amdsmi, load_amdsmi
from fleetserve.agent.discovery.base import Findings
from fleetserve.agent.discovery.sysfs import (
    hex_id,
    normalize_bus_id,
    read_int,
    read_key_values,
    read_text,
    subdirs,
)
from fleetserve.drivers import Driver
from fleetserve.inventory.hardware import GpuFacts

AMD_VENDOR_ID = 0x1002
# gfx targets that exist only as integrated GPUs (APUs) sharing the host's memory.
INTEGRATED_GFX_TARGETS = frozenset(
    {
        "gfx1151",  # Strix Halo: Ryzen AI Max 385/390/395, Radeon 8050S/8060S
        "gfx1150",  # Strix Point: Radeon 880M/890M
        "gfx1152",  # Krackan Point: Radeon 840M/860M
        "gfx1103",  # Phoenix, Hawk Point: Radeon 740M/760M/780M
        "gfx1037",  # Mendocino
        "gfx1036",  # Raphael, Granite Ridge (Ryzen 7000/9000 desktop iGPU)
        "gfx1035",  # Rembrandt: Radeon 660M/680M
        "gfx1033",  # Van Gogh
        "gfx90c",  # Renoir, Lucienne, Cezanne
    }
)
_CARD = re.compile(r"^card\d+$")
_RENDER = re.compile(r"^renderD(\d+)$")
_KFD_USE = re.compile(r"^(?:vram|stats)_(\d+)$")
_UE_COUNT = re.compile(r"^ue:\s*(\d+)", re.MULTILINE)


def gfx_target_from_version(version: int) -> str | None:
    """KFD's ``gfx_target_version`` as an LLVM target name.

    The version is major*10000 + minor*100 + stepping; the name writes minor and stepping in hex:
    90402 -> gfx942, 90010 -> gfx90a, 110501 -> gfx1151.
    """
    if version <= 0:
        return None
    major, minor, stepping = version // 10000, (version // 100) % 100, version % 100
    if minor > 15 or stepping > 15:
        return None
    return f"gfx{major}{minor:x}{stepping:x}"


@dataclass(frozen=True)
class KfdNode:
    """A GPU node of the KFD topology."""

    node: int
    gpu_id: int | None
    render_minor: int | None
    gfx_target: str | None
    unique_id: int | None


class AmdSysfsDiscoverer:
    """Finds AMD GPUs in sysfs under ``root``; no ``amdgpu`` driver means no GPU and no problem."""

    source = "sysfs"

    def __init__(self, root: Path | str = "/") -> None:
        self.root = Path(root)

    def discover(self) -> Findings:
        problems: list[str] = []
        nodes = self._kfd_nodes()
        pids = self._kfd_processes()
        by_minor = {n.render_minor: n for n in nodes if n.render_minor is not None}
        found: list[tuple[tuple[int, str], GpuFacts]] = []
        for card in subdirs(self.root / "sys/class/drm"):
            if not _CARD.match(card.name):
                continue  # renderD*, and connectors such as card1-DP-1
            device = card / "device"
            if read_int(device / "vendor", 16) != AMD_VENDOR_ID:
                continue
            facts, node = self._card(card, device, by_minor, pids, problems)
            # KFD order first (HIP's numbering); cards ROCm cannot see after them.
            order = (node.node if node is not None else 1 << 30, facts.pci_bus_id)
            found.append((order, facts))
        found.sort(key=lambda item: item[0])
        gpus = tuple(replace(facts, index=i) for i, (_, facts) in enumerate(found))
        return Findings(gpus=gpus, problems=tuple(problems))

    def _card(
        self,
        card: Path,
        device: Path,
        by_minor: dict[int, KfdNode],
        pids: dict[int, set[int]],
        problems: list[str],
    ) -> tuple[GpuFacts, KfdNode | None]:
        bus_id = self._bus_id(device)
        render_minor, render_node = self._render_node(device)
        node = by_minor.get(render_minor) if render_minor is not None else None
        where = f"amd: {card.name} ({bus_id})"
        if node is None:
            problems.append(
                f"{where}: no KFD topology node has its render node; ROCm cannot use it and its gfx target "
                "is unknown"
            )
        gfx = node.gfx_target if node is not None else None
        integrated = gfx in INTEGRATED_GFX_TARGETS
        vram = read_int(device / "mem_info_vram_total")
        gtt = read_int(device / "mem_info_gtt_total") or 0
        if vram is None:
            problems.append(f"{where}: mem_info_vram_total cannot be read; its memory is reported as 0")
        memory = (vram or 0) + (gtt if integrated else 0)
        used = read_int(device / "mem_info_vram_used")
        if integrated and used is not None:
            used += read_int(device / "mem_info_gtt_used") or 0
        device_id = read_int(device / "device", 16)
        name = read_text(device / "product_name") or (
            f"AMD {gfx}" if gfx else f"AMD GPU {hex_id(device_id or 0)}"
        )
        gpu_pids = pids.get(node.gpu_id, set()) if node is not None and node.gpu_id is not None else set()
        facts = GpuFacts(
            driver=Driver.AMD,
            index=0,
            uuid=self._uuid(device, node, bus_id),
            name=name,
            memory=memory,
            pci_vendor_id=hex_id(AMD_VENDOR_ID),
            pci_device_id=hex_id(device_id) if device_id is not None else "",
            gfx_target=gfx,
            ecc_uncorrected=self._uncorrected_errors(device),
            compute_pids=tuple(sorted(gpu_pids)),
            render_node=render_node,
            nvlink_peers=(),
            source=self.source,
            pci_bus_id=bus_id,
            memory_used=used,
            busy_percent=read_int(device / "gpu_busy_percent"),
            integrated=integrated,
        )
        return facts, node

    def _bus_id(self, device: Path) -> str:
        slot = read_key_values(device / "uevent").get("PCI_SLOT_NAME")
        if slot:
            return normalize_bus_id(slot)
        return normalize_bus_id(device.resolve().name)  # device is a link to .../0000:05:00.0

    def _render_node(self, device: Path) -> tuple[int | None, str | None]:
        for entry in subdirs(device / "drm"):
            match = _RENDER.match(entry.name)
            if match:
                return int(match.group(1)), f"/dev/dri/{entry.name}"
        return None, None

    def _uuid(self, device: Path, node: KfdNode | None, bus_id: str) -> str:
        # rocminfo writes "GPU-" + the 64-bit unique id in hex; without one the PCI address is stable.
        unique = read_int(device / "unique_id", 16)
        if unique is None and node is not None:
            unique = node.unique_id
        return f"GPU-{unique:016x}" if unique else bus_id

    def _uncorrected_errors(self, device: Path) -> int:
        match = _UE_COUNT.search(read_text(device / "ras/umc_err_count") or "")
        return int(match.group(1)) if match else 0

    def _kfd_nodes(self) -> list[KfdNode]:
        base = self.root / "sys/class/kfd/kfd/topology/nodes"
        nodes: list[KfdNode] = []
        for entry in sorted(subdirs(base), key=lambda p: int(p.name) if p.name.isdigit() else -1):
            if not entry.name.isdigit():
                continue
            props = read_key_values(entry / "properties")
            gfx = gfx_target_from_version(_int(props.get("gfx_target_version")) or 0)
            if gfx is None:
                continue  # a CPU node
            nodes.append(
                KfdNode(
                    node=int(entry.name),
                    gpu_id=read_int(entry / "gpu_id"),
                    render_minor=_int(props.get("drm_render_minor")),
                    gfx_target=gfx,
                    unique_id=_int(props.get("unique_id")),
                )
            )
        return nodes

    def _kfd_processes(self) -> dict[int, set[int]]:
        """gpu_id -> pids of the processes that hold memory or queues on it through KFD."""
        users: dict[int, set[int]] = {}
        for proc in subdirs(self.root / "sys/class/kfd/kfd/proc"):
            if not proc.name.isdigit():
                continue
            try:
                names = [p.name for p in proc.iterdir()]
            except OSError:
                continue
            for name in names:
                match = _KFD_USE.match(name)
                if match:
                    users.setdefault(int(match.group(1)), set()).add(int(proc.name))
        return users


class AmdDiscoverer:
    """AMD GPUs: sysfs for every fact, ``amdsmi`` (when importable) for UUIDs, names, processes and ECC."""

    def __init__(self, root: Path | str = "/", amdsmi: AmdSmiLibrary | bool = True) -> None:
        self.sysfs = AmdSysfsDiscoverer(root)
        # True: amdsmi if it imports here; False: sysfs alone; a library object: that one (tests).
        self.amdsmi: AmdSmiLibrary | None
        if amdsmi is True:
            self.amdsmi = load_amdsmi()
        elif amdsmi is False:
            self.amdsmi = None
        else:
            self.amdsmi = amdsmi

    def discover(self) -> Findings:
        found = self.sysfs.discover()
        if self.amdsmi is None or not found.gpus:
            return found
        return enrich_with_amdsmi(found, self.amdsmi)


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
