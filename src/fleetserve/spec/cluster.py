"""The ``Cluster`` document: a Kubernetes cluster fleetserve renders replicas into instead of
running them through node agents, with how its workloads claim devices and keep model files.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field

from fleetserve.spec.base import Name, Spec


class DeviceApi(StrEnum):
    """How a Kubernetes workload claims its devices."""

    DRA = "dra"  # a ResourceClaimTemplate per replica (resource.k8s.io/v1)
    PLUGIN = "plugin"  # device-plugin extended resources (nvidia.com/gpu, amd.com/gpu, ...)


class StorageMode(StrEnum):
    """Where a Kubernetes replica keeps its model files."""

    NODE = "node"  # one cache directory per node (hostPath), shared by the replicas on it
    REPLICA = "replica"  # a volume of its own per replica (a generic ephemeral volume)


class ModelStorage(Spec):
    """Model storage of a cluster's replicas: per node or per replica, never one shared volume."""

    mode: StorageMode = StorageMode.NODE
    host_path: str = Field(default="/var/lib/fleetserve/models", pattern=r"^/[^\x00]*$")
    # Only for mode: replica; omitted means the cluster's default StorageClass.
    storage_class: Name | None = None


class Cluster(Spec):
    """A Kubernetes cluster: the device classes its pools serve and how replicas are rendered."""

    kind: Literal["Cluster"] = "Cluster"
    name: Name
    # The device classes whose pools the cluster has; the built-in ``cpu`` names the CPU pool.
    # Their drivers select the serving stack. Omitted means none, never "every driver".
    classes: tuple[str, ...] = ()
    namespace: Name = "fleetserve"
    device_api: DeviceApi = DeviceApi.DRA
    storage: ModelStorage = ModelStorage()
    # Engine images by "ENGINE/VARIANT" (e.g. "llama.cpp/vulkan"), over the built-in defaults.
    images: dict[str, str] = Field(default_factory=dict)
    # The image of the model-fetching init container (fleetserve itself).
    fetcher_image: str | None = None
