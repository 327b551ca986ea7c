"""Discovered hardware → the ``Node`` the agent registers: GPUs onto device classes, HCAs onto fabrics.

Nothing discovered is dropped silently: a GPU no class recognises, or that two classes recognise
equally well, and an HCA no fabric claims, come back as ``Unmatched`` with the reason as data and a
sentence made from it.

GPU → class. A class matches a GPU when the class's driver is the GPU's driver and every match rule
the class gives holds: ``productName`` (a regular expression that must match the whole product name),
``pciVendorId``, ``pciDeviceIds`` (any of them) and ``gfxTarget`` (``gfx942`` also matches
``gfx942:sramecc+:xnack-``). The class giving the most rules that hold wins (``gfxTarget`` +
``pciDeviceIds`` beats ``gfxTarget`` alone); two winners at the same count are ambiguous. A class with
no rules at all is never matched by discovery: it is for devices declared in an inventory file.

Unified memory. A GPU whose memory is a share of the host's RAM (``GpuFacts.host_memory_shared``,
an Apple Silicon GPU: the share macOS lets it wire) has as much memory as that machine's OS gives
it, not as much as its model has: a class claiming more than the GPU may use does not match it
(placement would size replicas against memory the GPU cannot have). The node's host memory is
offered without that share, so what a replica claims of the host (``cpu.memory``) and what the
GPU holds are never the same bytes counted twice.

Device indices. A GPU keeps its driver's ordinal as its node index, so on a node with one GPU vendor
index 3 is ``CUDA_VISIBLE_DEVICES=3`` (or HIP's 3). On a node with GPUs of several drivers the
drivers are numbered one after the other in driver-table order (NVIDIA, then AMD), and the node
index is no longer the driver ordinal: translate through ``Device.uuid``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from ipaddress import IPv6Address
from types import MappingProxyType
from typing import Any

from pydantic import TypeAdapter
from pydantic import ValidationError as PydanticValidationError

from fleetserve.drivers import DRIVERS, Driver, parse_driver
from fleetserve.errors import ConfigError, Problem
from fleetserve.inventory.hardware import Discovery, GpuFacts, HcaFacts
from fleetserve.spec.base import Name
from fleetserve.spec.loader import problems_from_pydantic
from fleetserve.spec.nodeparts import CpuCapacity, Device, DeviceHealth, Hca
from fleetserve.spec.resources import DeviceClass, DeviceMatch, Node
from fleetserve.units import format_bytes

_ECC_MAX = 2**31 - 1  # DeviceHealth stores the count in a 32-bit column
_HEX16 = re.compile(r"^(0x)?[0-9a-fA-F]{1,4}$")
_GUID = re.compile(r"^(0x)?[0-9a-fA-F]{16}$")
_NAME: TypeAdapter[str] = TypeAdapter(Name)


def _fabric_name(value: str) -> str:
    try:
        return _NAME.validate_python(value)
    except PydanticValidationError as exc:
        raise ValueError(str(exc.errors()[0]["msg"]).removeprefix("Value error, ")) from None


# --- fabrics --------------------------------------------------------------------------------


def normalize_guid(text: str) -> str:
    """A 64-bit GUID as sysfs writes it, ``1070:fd03:008e:b580``; ``0x1070fd03008eb580`` is accepted too."""
    raw = text.strip().lower().replace(":", "")
    if not _GUID.match(raw):
        raise ValueError(f"{text!r} is not a 64-bit GUID; write 0x1070fd03008eb580 or 1070:fd03:008e:b580")
    raw = raw.removeprefix("0x")
    return ":".join(raw[i : i + 4] for i in range(0, 16, 4))


def normalize_subnet_prefix(text: str) -> str:
    """A GID subnet prefix (its first 64 bits) as ``fe80:0000:0000:0000``, from that form or ``fe80::/64``."""
    value = text.strip().lower().removesuffix("/64")
    groups = value.split(":")
    if len(groups) == 4 and all(re.fullmatch(r"[0-9a-f]{1,4}", g) for g in groups):
        return ":".join(g.zfill(4) for g in groups)
    try:
        address = IPv6Address(value if "::" in value else value + "::")
    except ValueError:
        raise ValueError(
            f"{text!r} is not a subnet prefix; write fe80:0000:0000:0000 (or fe80::/64)"
        ) from None
    exploded = address.exploded.split(":")
    if any(g != "0000" for g in exploded[4:]):
        raise ValueError(f"{text!r} sets bits past the 64-bit subnet prefix")
    return ":".join(exploded[:4])


@dataclass(frozen=True)
class FabricMap:
    """Which fabric an HCA attaches to, by port GUID or by subnet prefix; a GUID is the more specific.

    Loaded from ``{"portGuids": {GUID: fabric}, "subnetPrefixes": {PREFIX: fabric}}`` (either part may be
    left out). Two sections, not one mixed mapping: a GUID and a prefix are both four groups of four
    hex digits and could not be told apart.
    """

    port_guids: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    subnet_prefixes: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], location: str = "fabric map") -> FabricMap:
        """Parse the dict form; every bad key, GUID, prefix or fabric name is reported at once."""
        problems: list[Problem] = []
        sections = {"portGuids": normalize_guid, "subnetPrefixes": normalize_subnet_prefix}
        for key in raw:
            if key not in sections:
                problems.append(
                    Problem(location, str(key), f"unknown field; valid fields: {', '.join(sections)}")
                )
        parsed: dict[str, dict[str, str]] = {}
        for section, normalize in sections.items():
            entries = raw.get(section) or {}
            if not isinstance(entries, Mapping):
                problems.append(Problem(location, section, "must be a mapping of key to fabric name"))
                continue
            out: dict[str, str] = {}
            for key, fabric in entries.items():
                where = f"{section}.{key}"
                try:
                    normalized = normalize(str(key))
                    out[normalized] = _fabric_name(str(fabric))
                except ValueError as exc:
                    problems.append(Problem(location, where, str(exc)))
                    continue
            parsed[section] = out
        if problems:
            raise ConfigError(problems)
        return cls(
            port_guids=MappingProxyType(parsed.get("portGuids", {})),
            subnet_prefixes=MappingProxyType(parsed.get("subnetPrefixes", {})),
        )

    def fabrics_for(self, hca: HcaFacts) -> tuple[str, ...]:
        """The distinct fabrics the HCA's ports map to, each port by GUID first, else by subnet prefix."""
        found: list[str] = []
        for guid, prefix in zip(hca.port_guids, hca.subnet_prefixes, strict=False):
            fabric = self.port_guids.get(guid) or self.subnet_prefixes.get(prefix)
            if fabric and fabric not in found:
                found.append(fabric)
        return tuple(found)


# --- outcomes -------------------------------------------------------------------------------


class UnmatchedReason(StrEnum):
    """Why a discovered GPU or HCA is not on the node."""

    NO_MATCHING_CLASS = "NoMatchingClass"
    AMBIGUOUS_CLASS = "AmbiguousClass"
    NO_FABRIC = "NoFabric"
    CONFLICTING_FABRICS = "ConflictingFabrics"
    HCA_NOT_ACTIVE = "HcaNotActive"


class Mismatch(StrEnum):
    """The first rule of a device class that a GPU fails."""

    NO_RULES = "NoRules"
    UNKNOWN_DRIVER = "UnknownDriver"
    DRIVER = "Driver"
    PRODUCT_NAME = "ProductName"
    PCI_VENDOR_ID = "PciVendorId"
    PCI_DEVICE_ID = "PciDeviceId"
    GFX_TARGET = "GfxTarget"
    BAD_PATTERN = "BadPattern"
    MEMORY = "Memory"


@dataclass(frozen=True)
class ClassRejection:
    """One device class that does not match a GPU, and the first rule that failed."""

    device_class: str
    mismatch: Mismatch
    detail: str

    def __str__(self) -> str:
        return f"{self.device_class}: {self.detail}"


@dataclass(frozen=True)
class Unmatched:
    """A discovered GPU or HCA left off the node: the reason as data, and a sentence made from it."""

    subject: str
    reason: UnmatchedReason
    detail: str
    candidates: tuple[str, ...] = ()
    rejections: tuple[ClassRejection, ...] = ()
    gpu: GpuFacts | None = None
    hca: HcaFacts | None = None

    def __str__(self) -> str:
        return f"{self.subject}: {self.detail}"


# --- GPU → class ----------------------------------------------------------------------------


def _hex_equal(a: str, b: str) -> bool:
    a, b = a.strip().lower(), b.strip().lower()
    if _HEX16.match(a) and _HEX16.match(b):
        return int(a, 16) == int(b, 16)
    return a == b


def _gfx_equal(wanted: str, have: str | None) -> bool:
    if have is None:
        return False
    return have.lower().split(":")[0] == wanted.strip().lower().split(":")[0]


def _rule_count(match: DeviceMatch) -> int:
    return sum(
        (
            match.product_name is not None,
            match.pci_vendor_id is not None,
            bool(match.pci_device_ids),
            match.gfx_target is not None,
        )
    )


def _check(gpu: GpuFacts, cls: DeviceClass) -> ClassRejection | int:
    """The number of the class's rules the GPU meets (all of them), or why it does not match."""
    match = cls.match
    rules = _rule_count(match)
    driver = parse_driver(cls.driver)
    if rules == 0:
        return ClassRejection(cls.name, Mismatch.NO_RULES, "gives no match rules; discovery never picks it")
    if driver is None:
        return ClassRejection(
            cls.name,
            Mismatch.UNKNOWN_DRIVER,
            f"claims driver {cls.driver!r}, which is not one of {', '.join(d.value for d in DRIVERS)}",
        )
    if driver is not gpu.driver:
        return ClassRejection(
            cls.name,
            Mismatch.DRIVER,
            f"claims driver {driver.value}, the GPU is driven by {gpu.driver.value}",
        )
    if match.product_name is not None:
        try:
            pattern = re.compile(match.product_name)
        except re.error as exc:
            return ClassRejection(
                cls.name,
                Mismatch.BAD_PATTERN,
                f"productName {match.product_name!r} is not a valid regex ({exc})",
            )
        if not pattern.fullmatch(gpu.name):
            return ClassRejection(
                cls.name,
                Mismatch.PRODUCT_NAME,
                f"productName {match.product_name!r} does not match {gpu.name!r}",
            )
    if match.pci_vendor_id is not None and not _hex_equal(match.pci_vendor_id, gpu.pci_vendor_id):
        return ClassRejection(
            cls.name,
            Mismatch.PCI_VENDOR_ID,
            f"pciVendorId {match.pci_vendor_id} is not the GPU's {gpu.pci_vendor_id}",
        )
    if match.pci_device_ids and not any(_hex_equal(d, gpu.pci_device_id) for d in match.pci_device_ids):
        return ClassRejection(
            cls.name,
            Mismatch.PCI_DEVICE_ID,
            f"pciDeviceIds {list(match.pci_device_ids)} do not include the GPU's "
            f"{gpu.pci_device_id or 'unknown id'}",
        )
    if match.gfx_target is not None and not _gfx_equal(match.gfx_target, gpu.gfx_target):
        return ClassRejection(
            cls.name,
            Mismatch.GFX_TARGET,
            f"gfxTarget {match.gfx_target} is not the GPU's {gpu.gfx_target or 'unknown target'}",
        )
    if gpu.host_memory_shared and cls.memory > gpu.memory:
        return ClassRejection(
            cls.name,
            Mismatch.MEMORY,
            f"memory {format_bytes(cls.memory)} is more than the {format_bytes(gpu.memory)} of unified "
            f"memory this GPU may use; declare memory: {gpu.memory >> 20}MiB or less",
        )
    return rules


def _describe(gpu: GpuFacts) -> str:
    return f"{gpu.driver.value} GPU {gpu.index} ({gpu.name}, {gpu.uuid or gpu.pci_bus_id or 'no id'})"


def match_gpu(gpu: GpuFacts, classes: Mapping[str, DeviceClass]) -> str | Unmatched:
    """The name of the one most specific class that matches ``gpu``, or why there is none."""
    scores: dict[str, int] = {}
    rejections: list[ClassRejection] = []
    for name, cls in classes.items():
        outcome = _check(gpu, cls)
        if isinstance(outcome, ClassRejection):
            rejections.append(outcome)
        else:
            scores[name] = outcome
    subject = _describe(gpu)
    if not scores:
        detail = "no device class matches"
        if rejections:
            detail += "; " + "; ".join(str(r) for r in rejections)
        return Unmatched(
            subject, UnmatchedReason.NO_MATCHING_CLASS, detail, rejections=tuple(rejections), gpu=gpu
        )
    best = max(scores.values())
    winners = tuple(sorted(n for n, s in scores.items() if s == best))
    if len(winners) > 1:
        return Unmatched(
            subject,
            UnmatchedReason.AMBIGUOUS_CLASS,
            f"device classes {', '.join(winners)} match it equally well ({best} rules each); "
            "give one of them a more specific rule",
            candidates=winners,
            rejections=tuple(rejections),
            gpu=gpu,
        )
    return winners[0]


# --- node -----------------------------------------------------------------------------------


def _node_indices(gpus: Iterable[GpuFacts]) -> dict[tuple[Driver, int], int]:
    """Node index per (driver, driver ordinal): the ordinal itself when one driver is present."""
    order = list(DRIVERS)
    by_driver: dict[Driver, list[int]] = {}
    for gpu in gpus:
        by_driver.setdefault(gpu.driver, []).append(gpu.index)
    out: dict[tuple[Driver, int], int] = {}
    offset = 0
    for driver in sorted(by_driver, key=order.index):
        ordinals = sorted(by_driver[driver])
        for ordinal in ordinals:
            out[(driver, ordinal)] = offset + ordinal
        offset += max(ordinals) + 1
    return out


def _nvlink_domains(
    matched: list[tuple[int, GpuFacts]], node_index: Mapping[tuple[Driver, int], int]
) -> tuple[tuple[int, ...], ...]:
    """Connected components of the NVLink peer graph among matched devices; singletons left out."""
    present = {index for index, _ in matched}
    neighbours: dict[int, set[int]] = {index: set() for index in present}
    for index, gpu in matched:
        for peer in gpu.nvlink_peers:
            other = node_index.get((gpu.driver, peer))
            if other is not None and other in present and other != index:
                neighbours[index].add(other)
                neighbours[other].add(index)
    seen: set[int] = set()
    domains: list[tuple[int, ...]] = []
    for start in sorted(present):
        if start in seen:
            continue
        component: set[int] = set()
        stack = [start]
        while stack:
            current = stack.pop()
            if current in component:
                continue
            component.add(current)
            stack.extend(neighbours[current] - component)
        seen |= component
        if len(component) > 1:
            domains.append(tuple(sorted(component)))
    return tuple(domains)


def _attach_hcas(hcas: Iterable[HcaFacts], fabric_map: FabricMap) -> tuple[list[Hca], list[Unmatched]]:
    attached: list[Hca] = []
    unmatched: list[Unmatched] = []
    for hca in hcas:
        subject = f"HCA {hca.name}"
        fabrics = fabric_map.fabrics_for(hca)
        if not fabrics:
            keys = ", ".join(
                f"port GUID {g} / subnet prefix {p}"
                for g, p in zip(hca.port_guids, hca.subnet_prefixes, strict=False)
            )
            unmatched.append(
                Unmatched(
                    subject,
                    UnmatchedReason.NO_FABRIC,
                    f"no fabric is mapped to {keys}; it is not attached",
                    hca=hca,
                )
            )
        elif len(fabrics) > 1:
            unmatched.append(
                Unmatched(
                    subject,
                    UnmatchedReason.CONFLICTING_FABRICS,
                    f"its ports map to different fabrics ({', '.join(fabrics)}); an HCA attaches to one",
                    candidates=fabrics,
                    hca=hca,
                )
            )
        elif not hca.active:
            unmatched.append(
                Unmatched(
                    subject,
                    UnmatchedReason.HCA_NOT_ACTIVE,
                    f"maps to fabric {fabrics[0]} but its link is {hca.state}, not ACTIVE; "
                    "it is not attached",
                    candidates=fabrics,
                    hca=hca,
                )
            )
        else:
            attached.append(Hca(name=hca.name, fabric=fabrics[0]))
    return attached, unmatched


def to_node(
    discovery: Discovery,
    classes: Mapping[str, DeviceClass],
    fabric_map: FabricMap,
    name: str,
    labels: Mapping[str, str],
    own_pids: frozenset[int],
    model_cache: tuple[str, ...] = (),
) -> tuple[Node, tuple[Unmatched, ...]]:
    """The node to register for ``discovery``, and every GPU or HCA that could not be placed on it.

    A GPU's health carries its uncorrected ECC count and the compute processes on it that are not in
    ``own_pids`` (processes fleetserve did not start make the GPU not free).
    """
    unmatched: list[Unmatched] = []
    node_index = _node_indices(discovery.gpus)
    devices: list[Device] = []
    matched: list[tuple[int, GpuFacts]] = []
    for gpu in sorted(discovery.gpus, key=lambda g: node_index[(g.driver, g.index)]):
        outcome = match_gpu(gpu, classes)
        if isinstance(outcome, Unmatched):
            unmatched.append(outcome)
            continue
        index = node_index[(gpu.driver, gpu.index)]
        health = DeviceHealth(
            ecc_uncorrected=min(gpu.ecc_uncorrected, _ECC_MAX),
            foreign_processes=tuple(pid for pid in gpu.compute_pids if pid not in own_pids),
        )
        device = {"index": index, "uuid": gpu.uuid, "class": outcome, "health": health}
        devices.append(Device.model_validate(device))
        matched.append((index, gpu))
    hcas, hca_problems = _attach_hcas(discovery.hcas, fabric_map)
    unmatched.extend(hca_problems)
    host = discovery.host
    # Unified memory the GPUs may take is not the host's to offer as well.
    shared = sum(gpu.host_memory_shared for _, gpu in matched)
    try:
        node = Node(
            name=name,
            labels=dict(labels),
            cpu=CpuCapacity(
                cores=max(1, host.physical_cores),
                memory=max(0, host.memory_total - shared),
                numa_nodes=max(1, host.numa_nodes),
            ),
            devices=tuple(devices),
            hcas=tuple(hcas),
            nvlink_domains=_nvlink_domains(matched, node_index),
            model_cache=model_cache,
        )
    except PydanticValidationError as exc:
        raise ConfigError(problems_from_pydantic(exc, Node, f"node {name!r} built from discovery")) from exc
    return node, tuple(unmatched)
