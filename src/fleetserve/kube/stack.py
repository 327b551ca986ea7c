"""Serving-stack composition: which cluster components a cluster needs, from the drivers it claims.

The drivers claimed across a cluster's referenced classes select components from the driver
table (``DriverSpec.stack_components``); an absent list is empty, never "everything". A class
claiming a driver no component provides sets ``StackReady=False`` with reason
``UnsupportedDevices`` on the cluster, and composition goes on with what it can provide: a
component that already exists is never dropped by the gate (design.md, Multi-accelerator gating).
Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from kubernetes import client

from fleetserve.conditions import Condition, ConditionReason, ConditionType
from fleetserve.drivers import DRIVERS, Driver, host_driver, kube_drivers, parse_driver, stack_for
from fleetserve.errors import ConfigError, InternalError, Problem
from fleetserve.kube.objects import CLUSTER_LABEL, MANAGED_BY_KEY, MANAGER
from fleetserve.spec.cluster import Cluster
from fleetserve.spec.resources import DeviceClass

# The built-in class name a Cluster lists for its CPU pool (no DeviceClass document needed).
CPU_CLASS = "cpu"
STACK_CONFIGMAP_PREFIX = "fleetserve-stack-"


@dataclass(frozen=True)
class Component:
    """One serving-stack component: where it comes from and the namespace it runs in."""

    project: str
    namespace: str
    what: str


# Every component the driver table names. A component serves the drivers whose rows name it.
COMPONENTS: Mapping[str, Component] = MappingProxyType(
    {
        "nvidia-dra-driver-gpu": Component(
            "https://github.com/NVIDIA/k8s-dra-driver-gpu",
            "nvidia-dra-driver-gpu",
            "publishes NVIDIA GPUs as ResourceSlices; DeviceClass gpu.nvidia.com",
        ),
        "nvidia-gpu-operator": Component(
            "https://github.com/NVIDIA/gpu-operator",
            "gpu-operator",
            "driver, container toolkit and CDI on NVIDIA nodes",
        ),
        "dcgm-exporter": Component(
            "https://github.com/NVIDIA/dcgm-exporter", "gpu-operator", "NVIDIA GPU metrics for Prometheus"
        ),
        "amd-gpu-operator": Component(
            "https://github.com/ROCm/gpu-operator",
            "kube-amd-gpu",
            "AMD GPU operator in DRA mode; DeviceClass gpu.amd.com",
        ),
        "amd-device-metrics-exporter": Component(
            "https://github.com/ROCm/device-metrics-exporter",
            "kube-amd-gpu",
            "AMD GPU metrics for Prometheus",
        ),
        "nfd": Component(
            "https://github.com/kubernetes-sigs/node-feature-discovery",
            "node-feature-discovery",
            "labels nodes with their PCI devices and kernel features",
        ),
        "dra-driver-cpu": Component(
            "https://github.com/kubernetes-sigs/dra-driver-cpu",
            "kube-system",
            "exclusive CPUs through ResourceClaims; DeviceClass dra.cpu",
        ),
    }
)


def drivers_of_component(name: str) -> tuple[Driver, ...]:
    """The drivers whose rows of the driver table name component ``name``."""
    return tuple(d for d, spec in DRIVERS.items() if name in spec.stack_components)


def class_driver(name: str, classes: Mapping[str, DeviceClass]) -> str | None:
    """The driver a class a Cluster lists claims: its document's, ``dra.cpu`` for ``cpu``, or None."""
    if name in classes:
        return classes[name].driver
    if name == CPU_CLASS:
        return host_driver().value
    return None


AGENTS_ONLY_FIX = (
    "serve it through agents instead (`fleetserve agent` on the machine, joined to `fleetserve "
    "server`) and leave it out of what `fleetserve kube` renders"
)


def agents_only(driver_name: str) -> str | None:
    """Why the Kubernetes backend cannot claim ``driver_name``'s devices, from the driver table
    (``DriverSpec.kube_supported``); None where it can, or where the name is no driver (the gate's)."""
    driver = parse_driver(driver_name)
    if driver is None or driver in kube_drivers():
        return None
    return (
        f"driver {driver.value} has no DRA driver or device plugin, so Kubernetes cannot give a pod "
        f"its devices"
    )


def cluster_problems(cluster: Cluster, classes: Mapping[str, DeviceClass]) -> list[Problem]:
    """A Cluster's references to classes that do not exist or whose driver has no Kubernetes path,
    and repeated classes."""
    out = []
    seen: set[str] = set()
    for i, name in enumerate(cluster.classes):
        if name in seen:
            out.append(Problem(f"Cluster {cluster.name}", f"classes[{i}]", f"class {name!r} is listed twice"))
        seen.add(name)
        driver = class_driver(name, classes)
        why = agents_only(driver) if driver is not None else None
        if why is not None:
            out.append(
                Problem(f"Cluster {cluster.name}", f"classes[{i}]", f"class {name}: {why}; {AGENTS_ONLY_FIX}")
            )
        if driver is None:
            known = sorted({*classes, CPU_CLASS})
            out.append(
                Problem(
                    f"Cluster {cluster.name}",
                    f"classes[{i}]",
                    f"unknown device class {name!r}; known: {', '.join(known)} ('cpu' is the CPU pool)",
                )
            )
    return out


@dataclass(frozen=True)
class StackPlan:
    """A cluster's composed serving stack, and the condition it sets on the cluster."""

    cluster: str
    namespace: str
    # Every driver the cluster's classes claim, in the order first claimed (a list, maybe empty).
    claimed: tuple[str, ...]
    # Claimed drivers no component provides → the classes claiming them.
    unsupported: Mapping[str, tuple[str, ...]]
    # Components to have: those the supported claimed drivers select, then those kept.
    components: tuple[str, ...]
    # Components that exist but no claimed driver selects any more: kept, never removed here.
    kept: tuple[str, ...]
    condition: Condition

    @property
    def provided(self) -> tuple[Driver, ...]:
        """The claimed drivers the stack provides: the ones workloads may claim devices of."""
        return tuple(d for name in self.claimed if (d := parse_driver(name)) is not None)


def compose(cluster: Cluster, classes: Mapping[str, DeviceClass], existing: Sequence[str] = ()) -> StackPlan:
    """Compose ``cluster``'s stack; ``existing`` are the components it already has (all kept)."""
    problems = cluster_problems(cluster, classes)
    if problems:
        raise ConfigError(problems)
    claimed: dict[str, list[str]] = {}
    for name in cluster.classes:
        driver = class_driver(name, classes)
        if driver is None:
            raise InternalError(f"class {name}: cluster_problems let a class with no driver through")
        claimed.setdefault(driver, []).append(name)
    unsupported = {d: tuple(cs) for d, cs in claimed.items() if parse_driver(d) is None}
    provided = [d for name in claimed if (d := parse_driver(name)) is not None]
    selected = dict.fromkeys(stack_for(provided))
    kept = tuple(c for c in dict.fromkeys(existing) if c not in selected)
    if unsupported:
        what = "; ".join(
            f"{', '.join(f'class {c}' for c in cs)} claims driver {d}" for d, cs in unsupported.items()
        )
        condition = Condition(
            ConditionType.STACK_READY,
            False,
            ConditionReason.UNSUPPORTED_DEVICES,
            f"{what}, which no serving-stack component provides (supported: "
            f"{', '.join(sorted(d.value for d in DRIVERS))}); every existing component and workload "
            "is kept",
        )
    else:
        condition = Condition(
            ConditionType.STACK_READY,
            True,
            ConditionReason.COMPOSED,
            f"{len(selected)} components for drivers {', '.join(claimed) or 'none (no class listed)'}",
        )
    return StackPlan(
        cluster=cluster.name,
        namespace=cluster.namespace,
        claimed=tuple(claimed),
        unsupported=MappingProxyType(unsupported),
        components=(*selected, *kept),
        kept=kept,
        condition=condition,
    )


def stack_configmap_name(cluster: str) -> str:
    """The ConfigMap recording ``cluster``'s stack: one per cluster, so clusters never share one."""
    return STACK_CONFIGMAP_PREFIX + cluster


def stack_configmap(plan: StackPlan) -> client.V1ConfigMap:
    """The ConfigMap recording a cluster's stack and condition, read back as ``existing`` next time."""
    cond = plan.condition
    return client.V1ConfigMap(
        api_version="v1",
        kind="ConfigMap",
        metadata=client.V1ObjectMeta(
            name=stack_configmap_name(plan.cluster),
            namespace=plan.namespace,
            labels={MANAGED_BY_KEY: MANAGER, CLUSTER_LABEL: plan.cluster},
        ),
        data={
            "cluster": plan.cluster,
            "claimedDrivers": json.dumps(list(plan.claimed)),
            "components": json.dumps(list(plan.components)),
            "conditions": json.dumps(
                [
                    {
                        "type": cond.type,
                        "status": str(cond.status),
                        "reason": cond.reason,
                        "message": cond.message,
                    }
                ]
            ),
        },
    )


def components_recorded(configmap: Mapping[str, Any] | None) -> list[str]:
    """The components a stack ConfigMap (as a dict) records; empty for none or an unreadable one."""
    if not configmap:
        return []
    try:
        value = json.loads((configmap.get("data") or {}).get("components", "[]"))
    except (TypeError, ValueError):
        return []
    return [c for c in value if isinstance(c, str)] if isinstance(value, list) else []
