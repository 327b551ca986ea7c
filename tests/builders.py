"""Shared test builders: nodes named after their hardware shape, one deployment and one model builder.

Every suite builds its fleet from these (``from builders import nvidia_h100_80gb_x8``; tests/ is on
``sys.path`` through tests/conftest.py), so a node shape is written once. A shape fixes what a
machine has (cores, host memory, devices, NVLink domains); the device class name, the devices'
health, HCAs and any other Node field are arguments, because suites name their classes
differently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fleetserve.spec.resources import Deployment, Model, Node

GiB = 1 << 30


def devices(
    cls: str,
    count: int,
    *,
    uuid: str | None = None,
    node_name: str = "",
    ecc: Sequence[int] = (),
    ecc_errors: int = 1,
    foreign: Sequence[int] = (),
    health: bool = False,
) -> list[dict[str, Any]]:
    """``count`` device documents of class ``cls``, indexed from 0.

    ``uuid`` is a format of ``{node}`` (``node_name``) and ``{i}``, e.g. ``"{node}-gpu-{i}"``; the devices in ``ecc`` report
    ``ecc_errors`` uncorrected ECC errors and those in ``foreign`` a process fleetserve did not
    start. ``health`` spells the health out even when it is clean.
    """
    out: list[dict[str, Any]] = []
    for i in range(count):
        doc: dict[str, Any] = {"index": i}
        if uuid is not None:
            doc["uuid"] = uuid.format(node=node_name, i=i)
        doc["class"] = cls
        if health or ecc or foreign:
            doc["health"] = {
                "eccUncorrected": ecc_errors if i in ecc else 0,
                "foreignProcesses": [4242] if i in foreign else [],
            }
        out.append(doc)
    return out


def node(
    name: str,
    cores: int,
    memory: str | int,
    gpus: Sequence[dict[str, Any]] = (),
    *,
    groups: Sequence[tuple[str, int]] = (),
    domains: Sequence[Sequence[int]] = (),
    fabrics: Sequence[str] = (),
    **fields: Any,
) -> Node:
    """A node of ``cores`` cores and ``memory`` host memory with the device documents ``gpus``
    and the ``gpus:`` shorthand's (class, count) ``groups``; ``domains`` are its NVLink domains, ``fabrics`` give it two HCAs on each named fabric, and
    ``fields`` are any other Node field (``state``, ``labels``, ``cordon``, ``hcas``...)."""
    doc: dict[str, Any] = {"name": name, "cpu": {"cores": cores, "memory": memory}}
    if gpus:
        doc["devices"] = list(gpus)
    if groups:
        doc["gpus"] = [{"class": cls, "count": count} for cls, count in groups]
    if domains:
        doc["nvlinkDomains"] = [list(d) for d in domains]
    if fabrics:
        doc["hcas"] = [{"name": f"hca-{f}-{j}", "fabric": f} for f in fabrics for j in range(2)]
    return Node.model_validate(doc | fields)


# --- hardware shapes ---------------------------------------------------------------------------


def gpu_server_64c_512g(
    name: str, cls: str, count: int, *, domains: Sequence[Sequence[int]] = (), **fields: Any
) -> Node:
    """A GPU server of 64 cores and 512 GiB with ``count`` devices of class ``cls`` (device
    options such as ``ecc``, ``foreign``, ``uuid`` go to ``devices``; the rest to ``node``)."""
    dev_options = {
        k: fields.pop(k) for k in ("uuid", "ecc", "foreign", "ecc_errors", "health") if k in fields
    }
    return node(
        name, 64, "512GiB", devices(cls, count, node_name=name, **dev_options), domains=domains, **fields
    )


def nvidia_h100_80gb_x8(name: str, cls: str = "h100", **fields: Any) -> Node:
    """An HGX H100 board: 8 H100 80 GB in one NVLink domain, 64 cores, 512 GiB."""
    return gpu_server_64c_512g(name, cls, 8, domains=((0, 1, 2, 3, 4, 5, 6, 7),), **fields)


def amd_mi325x_x8(name: str, cls: str = "mi325x", **fields: Any) -> Node:
    """An AMD MI325X platform: 8 MI325X 256 GB (no NVLink domains), 64 cores, 512 GiB."""
    return gpu_server_64c_512g(name, cls, 8, **fields)


def gpu_host_32c_256g(name: str, cls: str, count: int = 2, **fields: Any) -> Node:
    """A 32-core, 256 GiB host with ``count`` devices of class ``cls`` (the ``gpus:`` shorthand)."""
    return node(name, 32, "256GiB", groups=[(cls, count)], **fields)


def gpu_host_16c_64g(name: str, cls: str, count: int = 4, **fields: Any) -> Node:
    """A 16-core, 64 GiB host with ``count`` devices of class ``cls`` (device options as for
    ``gpu_server_64c_512g``)."""
    dev_options = {
        k: fields.pop(k) for k in ("uuid", "ecc", "foreign", "ecc_errors", "health") if k in fields
    }
    return node(name, 16, "64Gi", devices(cls, count, node_name=name, **dev_options), **fields)


def gpu_host_8c_64g(name: str, cls: str, count: int = 2, **fields: Any) -> Node:
    """An 8-core, 64 GiB host with ``count`` devices of class ``cls`` (the ``gpus:`` shorthand)."""
    return node(name, 8, "64GiB", groups=[(cls, count)], **fields)


def cpu_32c_128g(name: str, **fields: Any) -> Node:
    """A CPU-only machine of 32 cores and 128 GiB."""
    return node(name, 32, "128GiB", **fields)


def cpu_8c_32g(name: str, **fields: Any) -> Node:
    """A CPU-only machine of 8 cores and 32 GiB."""
    return node(name, 8, "32Gi", **fields)


def cpu_8c_16g(name: str, **fields: Any) -> Node:
    """A CPU-only machine of 8 cores and 16 GiB."""
    return node(name, 8, "16Gi", **fields)


# --- deployments -------------------------------------------------------------------------------


def deployment(
    name: str = "d",
    replicas: int | dict[str, Any] = 1,
    *profiles: dict[str, Any],
    model: str = "m",
    **fields: Any,
) -> Deployment:
    """A deployment of ``model`` with ``profiles`` (documents or Profile values; default one vLLM profile ``p`` on
    class ``h100``) and any other Deployment field (``autoscale``, ``admission``...)."""
    profs = list(profiles) or [{"name": "p", "engine": "vllm", "deviceClass": "h100"}]
    return Deployment.model_validate(
        {"name": name, "model": model, "replicas": replicas, "profiles": profs} | fields
    )


# --- models ------------------------------------------------------------------------------------


def safetensors_8gb(name: str = "m") -> Model:
    """An 8 GB safetensors model on the Hub with a small KV shape (8 layers, 4 KV heads of 64)."""
    return Model.model_validate(
        {
            "name": name,
            "source": f"hf://org/{name}",
            "format": "safetensors",
            "size": "8GB",
            "architecture": {"layers": 8, "kvHeads": 4, "headDim": 64, "contextLength": 4096},
        }
    )
