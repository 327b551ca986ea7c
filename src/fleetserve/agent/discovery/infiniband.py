"""RDMA host channel adapters (InfiniBand and RoCE) from ``/sys/class/infiniband``.

Per port: ``gids/0`` is the port's default GID; its first 64 bits are the subnet prefix the subnet
manager assigned (``fe80:0000:0000:0000`` unless configured), its last 64 bits the port GUID (on RoCE,
an identifier derived from the interface's MAC address). ``state`` reads ``4: ACTIVE``,
``link_layer`` ``InfiniBand`` or ``Ethernet``.
"""

from __future__ import annotations

import re
from pathlib import Path

from fleetserve.agent.discovery.base import Findings
from fleetserve.agent.discovery.sysfs import read_text, subdirs
from fleetserve.inventory.hardware import HcaFacts

_GID = re.compile(r"^[0-9a-f]{4}(:[0-9a-f]{4}){7}$")
_ZERO_GID = ":".join(["0000"] * 8)


class InfinibandDiscoverer:
    """Finds HCAs under ``<root>/sys/class/infiniband``; a machine without RDMA has none."""

    source = "sysfs"

    def __init__(self, root: Path | str = "/") -> None:
        self.root = Path(root)

    def discover(self) -> Findings:
        base = self.root / "sys/class/infiniband"
        if not base.is_dir():
            return Findings()
        hcas: list[HcaFacts] = []
        problems: list[str] = []
        for hca_dir in subdirs(base):
            hca = self._hca(hca_dir, problems)
            if hca is not None:
                hcas.append(hca)
        return Findings(hcas=tuple(hcas), problems=tuple(problems))

    def _hca(self, hca_dir: Path, problems: list[str]) -> HcaFacts | None:
        ports = sorted(subdirs(hca_dir / "ports"), key=lambda p: int(p.name) if p.name.isdigit() else 0)
        guids: list[str] = []
        prefixes: list[str] = []
        states: list[str] = []
        layers: list[str] = []
        for port in ports:
            gid = (read_text(port / "gids/0") or "").lower()
            if not _GID.match(gid) or gid == _ZERO_GID:
                problems.append(
                    f"infiniband: {hca_dir.name} port {port.name}: no default GID "
                    f"(gids/0 reads {gid or 'nothing'}); the port is left out"
                )
                continue
            groups = gid.split(":")
            prefixes.append(":".join(groups[:4]))
            guids.append(":".join(groups[4:]))
            # "4: ACTIVE" -> "ACTIVE"
            states.append((read_text(port / "state") or "UNKNOWN").rpartition(":")[2].strip().upper())
            layers.append(read_text(port / "link_layer") or "unknown")
        if not guids:
            problems.append(f"infiniband: {hca_dir.name}: no port with a GID; the HCA is not reported")
            return None
        active = [i for i, state in enumerate(states) if state == "ACTIVE"]
        first = active[0] if active else 0
        return HcaFacts(
            name=hca_dir.name,
            port_guids=tuple(guids),
            subnet_prefixes=tuple(prefixes),
            link_layer=layers[first],
            state=states[first],
            node_guid=(read_text(hca_dir / "node_guid") or "").lower(),
        )
