"""Launch specs: what an engine adapter turns (profile, model file, shard, port) into.

A launch spec is data: the argv list (never a shell string), the environment (the driver
table's visible-devices variables for the runtime variant, the engine's API key: a secret is
never on an argv, which every user of the machine can read), the health and metrics URLs. The
supervisor runs it; each engine row's adapter (``ENGINES[kind].adapter``) builds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Protocol

from fleetserve.drivers import DRIVERS, Driver, RuntimeVariant
from fleetserve.engines.spec import Task
from fleetserve.sources import HfRepo, HttpSource
from fleetserve.spec.resources import ModelFormat, Profile, Replica


@dataclass(frozen=True)
class LaunchContext:
    """Everything an adapter needs to start one shard of one replica."""

    replica: Replica
    shard_index: int
    profile: Profile
    variant: RuntimeVariant
    driver: Driver
    model_path: Path
    binary: str
    host: str
    port: int
    context: int | None
    # Addresses of the replica's nodes, shard order; the first is the head of a multi-node group.
    peer_addresses: tuple[str, ...] = ()
    # How the engine names its model when not by ``model_path`` (e.g. a Hugging Face repo the
    # engine downloads itself, in a Kubernetes pod); empty means the file at ``model_path``.
    model_args: tuple[str, ...] = ()
    # The API key the engine demands of every request (in its environment, never on its argv).
    engine_key: str | None = field(default=None, repr=False)
    # What the deployment serves (``Deployment.task``): the engine row's ``tasks`` say how it starts.
    task: Task = Task.GENERATE
    # The draft model's weights in the node's cache, for a profile whose ``speculative`` has one.
    draft_path: Path | None = None
    # The deployment's LoRA adapters in the node's cache, (name, path) in the deployment's order:
    # the engine loads them at start (``--lora``, ``--lora-modules``).
    adapters: tuple[tuple[str, Path], ...] = ()
    # Where the engine publishes its KV cache events, for an engine whose row has ``kv_events``:
    # a ZMQ endpoint on the node's loopback its agent bound (None: it publishes none).
    kv_events_endpoint: str | None = None

    @property
    def devices(self) -> tuple[int, ...]:
        return self.replica.shards[self.shard_index].devices

    @property
    def is_head(self) -> bool:
        return self.shard_index == 0


@dataclass(frozen=True)
class LaunchSpec:
    """One shard's processes: sidecars started first (e.g. a Ray worker), then the engine."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(repr=False)
    health_url: str | None
    metrics_url: str | None
    sidecars: tuple[tuple[str, ...], ...] = ()
    served_name: str = ""
    port: int = 0
    notes: tuple[str, ...] = field(default=())


class EngineAdapter(Protocol):
    """Builds one engine's command lines: on a node for an agent, and in a pod."""

    def launch(self, ctx: LaunchContext) -> LaunchSpec:
        """The launch spec of one shard."""
        ...

    def pod_model_args(self, text: str, source: HfRepo | HttpSource, fmt: ModelFormat) -> tuple[str, ...]:
        """How the engine names a model it downloads itself in a pod; SourceError when it cannot."""
        ...


def url_host(host: str) -> str:
    """``host`` as it goes into a URL or host:port: IPv6 addresses in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def visible_devices_env(
    driver: Driver, variant: RuntimeVariant, devices: tuple[int, ...]
) -> Mapping[str, str]:
    """The driver table's visible-devices variables for ``variant``, set to ``devices``."""
    names = DRIVERS[driver].visible_devices_env.get(variant, ())
    value = ",".join(str(d) for d in devices)
    return MappingProxyType({name: value for name in names})
