"""``amdsmi``, AMD's management library, where it is installed (it ships with ROCm, not on PyPI).

It adds what sysfs says less well: the GPU's UUID, its marketing name when the board has no
``product_name``, the processes using it (also those that reach it without KFD) and the ECC error
count. sysfs stays the source of memory, gfx target and render node. Any failure of the library
leaves the sysfs facts as they are and says so in one problem.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol, cast

from fleetserve.agent.discovery.base import Findings
from fleetserve.agent.discovery.sysfs import normalize_bus_id
from fleetserve.inventory.hardware import GpuFacts


class AmdSmiLibrary(Protocol):
    """The ``amdsmi`` calls discovery makes, named as the ``amdsmi`` Python package names them."""

    def amdsmi_init(self) -> None: ...
    def amdsmi_shut_down(self) -> None: ...
    def amdsmi_get_processor_handles(self) -> Sequence[object]: ...
    def amdsmi_get_gpu_device_bdf(self, handle: object, /) -> str: ...
    def amdsmi_get_gpu_device_uuid(self, handle: object, /) -> str: ...
    def amdsmi_get_gpu_asic_info(self, handle: object, /) -> Mapping[str, Any]: ...
    def amdsmi_get_gpu_process_list(self, handle: object, /) -> Sequence[Any]: ...
    def amdsmi_get_gpu_total_ecc_count(self, handle: object, /) -> Mapping[str, Any]: ...


def load_amdsmi() -> AmdSmiLibrary | None:
    """The ``amdsmi`` module if it imports here, else None (the usual case outside ROCm machines)."""
    try:
        module = importlib.import_module("amdsmi")
    except Exception:
        return None
    return cast(AmdSmiLibrary, module)


def enrich_with_amdsmi(found: Findings, lib: AmdSmiLibrary) -> Findings:
    """``found`` (from sysfs) with each GPU's amdsmi facts merged in, matched by PCI address."""
    try:
        lib.amdsmi_init()
    except Exception as exc:
        return replace(
            found, problems=(*found.problems, f"amd: amdsmi could not start ({exc}); using sysfs alone")
        )
    problems = list(found.problems)
    try:
        extra: dict[str, dict[str, Any]] = {}
        for handle in lib.amdsmi_get_processor_handles():
            facts = _read(lib, handle, problems)
            if facts:
                extra[facts["bus_id"]] = facts
    except Exception as exc:
        problems.append(f"amd: amdsmi failed listing GPUs ({exc}); using sysfs alone")
        extra = {}
    finally:
        with contextlib.suppress(Exception):
            lib.amdsmi_shut_down()
    gpus = tuple(_merge(gpu, extra.get(gpu.pci_bus_id)) for gpu in found.gpus)
    return replace(found, gpus=gpus, problems=tuple(problems))


def _read(lib: AmdSmiLibrary, handle: object, problems: list[str]) -> dict[str, Any]:
    try:
        bus_id = normalize_bus_id(lib.amdsmi_get_gpu_device_bdf(handle))
    except Exception as exc:
        problems.append(f"amd: amdsmi cannot tell a GPU's PCI address ({exc}); it keeps its sysfs facts")
        return {}
    out: dict[str, Any] = {"bus_id": bus_id}
    readers: dict[str, Callable[[], object]] = {
        "uuid": lambda: str(lib.amdsmi_get_gpu_device_uuid(handle)),
        "name": lambda: str(lib.amdsmi_get_gpu_asic_info(handle).get("market_name") or ""),
        "pids": lambda: _pids(lib.amdsmi_get_gpu_process_list(handle)),
        "ecc": lambda: int(lib.amdsmi_get_gpu_total_ecc_count(handle).get("uncorrectable_count") or 0),
    }
    for key, read in readers.items():
        try:
            out[key] = read()
        except Exception as exc:
            problems.append(f"amd: {bus_id}: amdsmi cannot read its {key} ({exc}); the sysfs value stays")
    return out


def _pids(processes: Sequence[Any]) -> tuple[int, ...]:
    # ROCm 6 returns dicts with "pid"; older releases returned objects with a pid attribute.
    pids = set()
    for process in processes:
        pid = process.get("pid") if isinstance(process, Mapping) else getattr(process, "pid", None)
        if isinstance(pid, int) and pid > 0:
            pids.add(pid)
    return tuple(sorted(pids))


def _merge(gpu: GpuFacts, extra: dict[str, Any] | None) -> GpuFacts:
    if not extra:
        return gpu
    uuid = extra.get("uuid") or gpu.uuid
    name = gpu.name
    # sysfs names a board by its FRU product_name; without one it only knows the gfx target.
    if extra.get("name") and (
        not gpu.name or gpu.name.startswith("AMD gfx") or gpu.name.startswith("AMD GPU ")
    ):
        name = extra["name"]
    pids = tuple(sorted(set(gpu.compute_pids) | set(extra.get("pids", ()))))
    ecc = max(gpu.ecc_uncorrected, int(extra.get("ecc", 0)))
    return replace(gpu, uuid=uuid, name=name, compute_pids=pids, ecc_uncorrected=ecc, source="amdsmi+sysfs")
