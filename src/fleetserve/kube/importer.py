"""Inventory import from a Kubernetes cluster: its Nodes and DRA ResourceSlices → fleetserve ``Node``s.

``nodes_from_cluster`` is a pure conversion of plain API JSON (camelCase, as ``kubectl get nodes -o
json`` and ``kubectl get resourceslices -o json`` write the items); ``read_cluster_inventory`` is the
only function here that talks to a cluster, and ``dump_nodes`` writes the result as fleetserve YAML.

Every Kubernetes Node becomes a fleetserve node: its labels less the noisy
``kubernetes.io/``-style ones, CPU cores and memory from ``status.allocatable``, NotReady unless the
``Ready`` condition is ``"True"``, a cordon when ``spec.unschedulable``, the InternalIP as address,
and an HCA per ``fabric.fleetserve.io/<fabric>=attached`` label. Its GPUs come from the
ResourceSlices the NVIDIA and AMD DRA drivers publish for it (``resource.k8s.io/v1``; the
``v1beta1`` ``basic`` wrapper is read too): each device is described as discovery would describe
it (``GpuFacts``) and matched onto a device class by ``fleetserve.inventory.matching.match_gpu``.

Nothing is dropped silently: a device no class recognises (or two recognise equally well), a GPU
partition, a slice of a driver fleetserve does not import, a slice naming a node the cluster does
not list, and a node that cannot be read each leave one sentence in ``ImportResult.unmatched``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_FLOOR, Decimal
from types import MappingProxyType
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError as PydanticValidationError
from urllib3.exceptions import HTTPError as TransportError

from fleetserve.drivers import DRIVERS, Driver, SliceFormat, parse_driver
from fleetserve.errors import InternalError
from fleetserve.inventory.hardware import GpuFacts
from fleetserve.inventory.matching import Unmatched, match_gpu
from fleetserve.kube.apply import REQUEST_TIMEOUT, KubeError, describe_api_error
from fleetserve.kube.objects import plain
from fleetserve.kube.render import FABRIC_LABEL_PREFIX
from fleetserve.spec.nodeparts import Cordon, CpuCapacity, Device, Hca
from fleetserve.spec.resources import DeviceClass, Node, NodeState

# Label prefixes Kubernetes and its add-ons set on every node; they say nothing an operator chose.
NOISY_LABEL_PREFIXES = ("kubernetes.io/", "k8s.io/", "node.kubernetes.io/", "feature.node.kubernetes.io/")
FABRIC_ATTACHED = "attached"
CORDON_REASON = "cordoned in Kubernetes (spec.unschedulable)"
SOURCE = "resourceslice"


# The GPU drivers whose ResourceSlices are imported: the driver table's rows that say how.
SLICE_FORMATS: Mapping[Driver, SliceFormat] = MappingProxyType(
    {d: spec.resource_slice for d, spec in DRIVERS.items() if spec.resource_slice is not None}
)
# Drivers whose slices carry no GPU: the CPU pool's dra.cpu devices describe the node's cores.
NON_GPU_DRIVERS = frozenset(d for d, spec in DRIVERS.items() if not spec.is_accelerator)


@dataclass(frozen=True)
class ImportResult:
    """The nodes read from a cluster, and a sentence per thing that could not be imported."""

    nodes: list[Node]
    unmatched: list[str]


# --- quantities ------------------------------------------------------------------------------

_QUANTITY = re.compile(
    r"^(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+))"
    r"(?:(?P<binary>Ki|Mi|Gi|Ti|Pi|Ei)|(?P<exponent>[eE][+-]?\d+)|(?P<decimal>[numkMGTPE]?))$"
)
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}
# Kubernetes keeps a quantity in 63 bits (at most about 9.2e18); a larger magnitude is refused
# before it is expanded (``1e400000`` took 4 s of CPU to turn into an int).
_MAX_MAGNITUDE = 19
_SHIFT = {"Ki": 4, "Mi": 7, "Gi": 10, "Ti": 13, "Pi": 16, "Ei": 19}


def parse_quantity(value: object) -> Decimal:
    """A Kubernetes resource quantity (``"112"``, ``"111500m"``, ``"2113290Mi"``, ``"1e3"``) as a number.

    Raises ValueError naming the value when it is not a quantity.
    """
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (expected a string such as '16Gi')")
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{value!r} is not a Kubernetes quantity (not a finite number)")
        return Decimal(str(value))
    match = _QUANTITY.match(value.strip())
    if not match:
        raise ValueError(
            f"{value!r} is not a Kubernetes quantity; expected a number with an optional suffix "
            "(Ki, Mi, Gi, Ti, Pi, Ei, n, u, m, k, M, G, T, P, E or an exponent such as e3)"
        )
    exponent = match["exponent"]
    try:
        number = Decimal(match["number"])
        if len(exponent or "") > 8:
            raise ArithmeticError("its exponent is out of range")
        shift = int(exponent[1:]) if exponent else _SHIFT.get(match["binary"] or "", 0)
        if not exponent and not match["binary"]:
            shift = _DECIMAL[match["decimal"] or ""].adjusted()
        if number and number.adjusted() + shift > _MAX_MAGNITUDE:
            raise ValueError(
                f"{value!r} is larger than any Kubernetes quantity (at most about 9.2e18); "
                "give the real amount, e.g. 128 or 512Gi"
            )
        if match["binary"]:
            return number * _BINARY[match["binary"]]
        if match["exponent"]:
            return number.scaleb(int(match["exponent"][1:]))
        return number * _DECIMAL[match["decimal"] or ""]
    except ArithmeticError as exc:  # decimal's InvalidOperation, Overflow
        raise ValueError(f"{value!r} is not a Kubernetes quantity ({exc})") from None


def _non_negative_int(value: object, what: str) -> int:
    number = parse_quantity(value)
    if number < 0:
        raise ValueError(f"{value!r} is negative; {what} cannot be")
    return int(number.to_integral_value(rounding=ROUND_FLOOR))


def quantity_cores(value: object) -> int:
    """Whole CPU cores in a CPU quantity, rounded down: ``"111500m"`` → 111."""
    return _non_negative_int(value, "a CPU quantity")


def quantity_bytes(value: object) -> int:
    """Bytes in a memory quantity, rounded down: ``"512Gi"`` → 549755813888."""
    return _non_negative_int(value, "a memory quantity")


# --- reading the API's JSON -------------------------------------------------------------------


def _map(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: object) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else []


def _name(obj: Mapping[str, Any]) -> str:
    return str(_map(obj.get("metadata")).get("name") or "?")


def _attribute(device: Mapping[str, Any], driver: str, name: str) -> object:
    """A device attribute's value, whatever its type; ``name`` may be written qualified by the driver."""
    attributes = _map(device.get("attributes"))
    raw = attributes.get(name, attributes.get(f"{driver}/{name}"))
    typed = _map(raw)
    for kind in ("string", "int", "bool", "version"):
        if kind in typed:
            return typed[kind]
    return None


def _device_fields(device: Mapping[str, Any]) -> Mapping[str, Any]:
    """A device's fields; ``resource.k8s.io/v1beta1`` nests them under ``basic``."""
    basic = device.get("basic")
    return {**device, **basic} if isinstance(basic, Mapping) else device


def _named(parse: Callable[[object], int], value: object, field: str) -> int:
    try:
        return parse(value)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None


def _quantity_field(block: Mapping[str, Any], key: str) -> object:
    return _map(block.get("allocatable")).get(key, _map(block.get("capacity")).get(key))


def _labels(raw: Mapping[str, Any]) -> dict[str, str]:
    return {
        str(k): str(v)
        for k, v in raw.items()
        if not any(str(k).startswith(prefix) for prefix in NOISY_LABEL_PREFIXES)
    }


def _state(status: Mapping[str, Any]) -> NodeState:
    for condition in _list(status.get("conditions")):
        if _map(condition).get("type") == "Ready":
            return NodeState.READY if _map(condition).get("status") == "True" else NodeState.NOT_READY
    return NodeState.NOT_READY


def _address(status: Mapping[str, Any]) -> str:
    for address in _list(status.get("addresses")):
        if _map(address).get("type") == "InternalIP" and _map(address).get("address"):
            return str(_map(address)["address"])
    return ""


def _hcas(node: str, labels: Mapping[str, Any], problems: list[str]) -> tuple[Hca, ...]:
    out: list[Hca] = []
    for key, value in sorted(labels.items()):
        key = str(key)
        if not key.startswith(FABRIC_LABEL_PREFIX):
            continue
        fabric = key.removeprefix(FABRIC_LABEL_PREFIX)
        if value != FABRIC_ATTACHED:
            problems.append(
                f"node {node}: label {key}={value} is not {key}={FABRIC_ATTACHED}; "
                f"no HCA on fabric {fabric} is imported"
            )
            continue
        try:
            out.append(Hca(name=fabric, fabric=fabric))
        except PydanticValidationError as exc:
            reason = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
            problems.append(f"node {node}: label {key}: {reason}; no HCA is imported for it")
    return tuple(out)


@dataclass(frozen=True)
class _SliceDevice:
    driver: Driver
    slice_name: str
    device: Mapping[str, Any]


def _gpu_facts(node: str, order: int, item: _SliceDevice, fmt: SliceFormat) -> GpuFacts:
    driver, device = item.driver.value, item.device
    name = str(device.get("name") or f"device-{order}")
    index = _attribute(device, driver, fmt.index_attribute)
    uuid = _attribute(device, driver, "uuid")
    product = _attribute(device, driver, "productName")
    memory = _map(_map(device.get("capacity")).get("memory")).get("value")
    gfx = _attribute(device, driver, "gfxTarget")
    bus = _attribute(device, driver, "pcieBusID")
    return GpuFacts(
        driver=item.driver,
        index=index if isinstance(index, int) and not isinstance(index, bool) and index >= 0 else order,
        uuid=str(uuid) if uuid else f"{node}/{name}",
        name=str(product) if product is not None else "",
        memory=quantity_bytes(memory) if memory is not None else 0,
        pci_vendor_id=fmt.pci_vendor_id,
        pci_device_id="",
        gfx_target=str(gfx) if gfx else None,
        ecc_uncorrected=0,
        compute_pids=(),
        render_node=None,
        nvlink_peers=(),
        source=SOURCE,
        pci_bus_id=str(bus) if bus else "",
    )


def _numa_nodes(devices: Sequence[_SliceDevice]) -> int:
    """Distinct NUMA nodes among the node's CPU devices (one per NUMA node in dra.cpu's grouped mode)."""
    found: set[object] = set()
    for item in devices:
        for key, raw in _map(item.device.get("attributes")).items():
            if str(key).split("/")[-1].lower() in ("numanodeid", "numanode"):
                value = _map(raw).get("int")
                if value is not None:
                    found.add(value)
    return max(1, len(found))


def _devices(
    node: str, gpus: Sequence[_SliceDevice], classes: Mapping[str, DeviceClass], problems: list[str]
) -> tuple[Device, ...]:
    matched: list[tuple[GpuFacts, str, str]] = []
    for order, item in enumerate(gpus):
        fmt = SLICE_FORMATS[item.driver]
        device_name = str(item.device.get("name") or f"device-{order}")
        kind = _attribute(item.device, item.driver.value, "type")
        product = _attribute(item.device, item.driver.value, "productName")
        if kind in fmt.partition_types:
            problems.append(
                f"node {node}: {item.driver.value} device {device_name} ({product or 'no product name'}) "
                f"in ResourceSlice {item.slice_name} is a GPU partition (type {kind}); "
                "partitions are not imported"
            )
            continue
        try:
            gpu = _gpu_facts(node, order, item, fmt)
        except ValueError as exc:
            problems.append(
                f"node {node}: {item.driver.value} device {device_name} in ResourceSlice "
                f"{item.slice_name}: {exc}; not imported"
            )
            continue
        outcome = match_gpu(gpu, classes)
        if isinstance(outcome, Unmatched):
            problems.append(f"node {node}: device {device_name}: {outcome}")
            continue
        matched.append((gpu, outcome, device_name))
    # Node indices: the driver's own ordinal where it is free, drivers in driver-table order.
    order_of = list(DRIVERS)
    matched.sort(key=lambda m: (order_of.index(m[0].driver), m[0].index))
    taken = {gpu.index for gpu, _, _ in matched}
    used: set[int] = set()
    devices: list[Device] = []
    for gpu, device_class, device_name in matched:
        index = gpu.index
        if index in used:
            index = max(taken | used) + 1
            problems.append(
                f"node {node}: {gpu.driver.value} device {device_name} has index {gpu.index}, which "
                f"another device of the node already has; imported as index {index} (translate "
                f"through its uuid {gpu.uuid})"
            )
        try:
            device = Device.model_validate({"index": index, "uuid": gpu.uuid, "class": device_class})
        except PydanticValidationError as exc:
            reason = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
            problems.append(f"node {node}: device {device_name} (index {index}): {reason}; not imported")
            continue
        used.add(index)
        devices.append(device)
    return tuple(sorted(devices, key=lambda d: d.index))


def _node(
    raw: Mapping[str, Any],
    gpus: Sequence[_SliceDevice],
    cpus: Sequence[_SliceDevice],
    classes: Mapping[str, DeviceClass],
    problems: list[str],
) -> Node:
    """One fleetserve node; ValueError (or pydantic's) when the Kubernetes node cannot be read."""
    name = _name(raw)
    meta, spec, status = _map(raw.get("metadata")), _map(raw.get("spec")), _map(raw.get("status"))
    raw_labels = _map(meta.get("labels"))
    cpu, memory = _quantity_field(status, "cpu"), _quantity_field(status, "memory")
    if cpu is None or memory is None:
        raise ValueError("status.allocatable gives no cpu or no memory")
    cores = _named(quantity_cores, cpu, "status.allocatable.cpu")
    memory_bytes = _named(quantity_bytes, memory, "status.allocatable.memory")
    if cores < 1:
        raise ValueError(f"allocatable cpu {cpu} is less than one core")
    return Node(
        name=name,
        labels=_labels(raw_labels),
        state=_state(status),
        cordon=Cordon(reason=CORDON_REASON) if spec.get("unschedulable") is True else None,
        cpu=CpuCapacity(cores=cores, memory=memory_bytes, numa_nodes=_numa_nodes(cpus)),
        devices=_devices(name, gpus, classes, problems),
        hcas=_hcas(name, raw_labels, problems),
        address=_address(status),
    )


def nodes_from_cluster(
    nodes: Sequence[Mapping[str, Any]],
    slices: Sequence[Mapping[str, Any]],
    classes: Mapping[str, DeviceClass],
) -> ImportResult:
    """The cluster's nodes as fleetserve nodes, their GPUs matched onto ``classes``; see the module doc."""
    problems: list[str] = []
    names = [_name(n) for n in nodes]
    gpus: dict[str, list[_SliceDevice]] = {n: [] for n in names}
    cpus: dict[str, list[_SliceDevice]] = {n: [] for n in names}
    for sl in slices:
        slice_name = _name(sl)
        spec = _map(sl.get("spec"))
        driver_name = str(spec.get("driver") or "")
        devices = [_device_fields(_map(d)) for d in _list(spec.get("devices"))]
        device_names = ", ".join(str(d.get("name", "?")) for d in devices) or "none"
        node = spec.get("nodeName")
        driver = parse_driver(driver_name)
        if driver not in SLICE_FORMATS and driver not in NON_GPU_DRIVERS:
            if devices:
                problems.append(
                    f"ResourceSlice {slice_name}: driver {driver_name or '(none)'} is not one whose devices "
                    f"fleetserve imports ({', '.join(d.value for d in SLICE_FORMATS)}); its "
                    f"{len(devices)} device(s) ({device_names}) are not imported"
                )
            continue
        if not isinstance(node, str) or not node:
            if devices and driver not in NON_GPU_DRIVERS:
                problems.append(
                    f"ResourceSlice {slice_name} ({driver_name}) is not bound to one node "
                    f"(no spec.nodeName); its {len(devices)} device(s) ({device_names}) are not imported"
                )
            continue
        if node not in gpus:
            problems.append(
                f"ResourceSlice {slice_name} ({driver_name}) names node {node}, which the cluster does not "
                f"list; its {len(devices)} device(s) ({device_names}) are not imported"
            )
            continue
        if driver is None:
            raise InternalError(f"ResourceSlice {slice_name}: driver {driver_name} passed the check unparsed")
        target = cpus if driver in NON_GPU_DRIVERS else gpus
        target[node].extend(_SliceDevice(driver, slice_name, d) for d in devices)
    out: list[Node] = []
    for raw, name in zip(nodes, names, strict=True):
        node_problems: list[str] = []
        try:
            out.append(_node(raw, gpus[name], cpus[name], classes, node_problems))
        except (ValueError, PydanticValidationError) as exc:
            reason, where = str(exc), ""
            if isinstance(exc, PydanticValidationError):
                first = exc.errors()[0]
                reason = str(first["msg"]).removeprefix("Value error, ")
                loc = ".".join(str(part) for part in first["loc"])
                where = f"{loc}: " if loc else ""
            problems.append(f"node {name}: cannot be imported: {where}{reason}; its devices are not imported")
            continue
        problems.extend(node_problems)
    return ImportResult(nodes=out, unmatched=problems)


# --- I/O ---------------------------------------------------------------------------------------


def read_cluster_inventory(api: client.ApiClient) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The cluster's Nodes and ``resource.k8s.io/v1`` ResourceSlices as plain camelCase dicts.

    A cluster without the DRA API (ResourceSlices answer 404) has no slices. Any other refusal,
    or an unreachable API server, raises KubeError saying which listing failed.
    """
    try:
        listed = client.CoreV1Api(api).list_node(_request_timeout=REQUEST_TIMEOUT).items
    except ApiException as exc:
        raise KubeError(f"listing the cluster's nodes: {describe_api_error(exc)}") from exc
    except (TransportError, OSError) as exc:
        raise KubeError(f"listing the cluster's nodes: cannot reach the Kubernetes API: {exc}") from exc
    # List items come without their type; put it back so they read like `kubectl get -o json` items.
    nodes = [{"apiVersion": "v1", "kind": "Node", **plain(item)} for item in listed]
    try:
        listed_slices = client.ResourceV1Api(api).list_resource_slice(_request_timeout=REQUEST_TIMEOUT).items
    except ApiException as exc:
        if exc.status == 404:  # no resource.k8s.io/v1 (DRA) API: no slices
            return nodes, []
        raise KubeError(
            f"listing the cluster's ResourceSlices (resource.k8s.io/v1): {describe_api_error(exc)}"
        ) from exc
    except (TransportError, OSError) as exc:
        raise KubeError(
            f"listing the cluster's ResourceSlices: cannot reach the Kubernetes API: {exc}"
        ) from exc
    slices = [
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", **plain(item)} for item in listed_slices
    ]
    return nodes, slices


def dump_nodes(result: ImportResult) -> str:
    """The imported nodes as fleetserve YAML (``kind: Node`` documents), unmatched sentences on top."""
    header = [f"# {len(result.nodes)} node(s) imported from Kubernetes by fleetserve."]
    if result.unmatched:
        header.append(f"# Not imported ({len(result.unmatched)}):")
        header.extend("#   - " + " ".join(line.split()) for line in result.unmatched)
    docs = [
        {"kind": "Node", **node.model_dump(by_alias=True, mode="json", exclude_defaults=True)}
        for node in result.nodes
    ]
    body = yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False, width=100) if docs else ""
    return "\n".join(header) + "\n" + body
