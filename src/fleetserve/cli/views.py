"""How the admin CLI shows the admin API's answers (``adminapi``'s models): kinds, the model each
kind is read as, table columns, rollout progress, decisions; reading YAML to apply."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from rich.console import Console

from fleetserve.adminapi.credentials import EnrolmentView
from fleetserve.adminapi.endpoints import EndpointView
from fleetserve.adminapi.fleet import (
    DeploymentDetail,
    DeploymentView,
    Explanation,
    FleetView,
    NodeView,
    ReplicaView,
)
from fleetserve.cli.output import Column, Format, emit
from fleetserve.conditions import ConditionType
from fleetserve.errors import ConfigError, Problem
from fleetserve.protocol import AgentStatus
from fleetserve.spec.adapter import Adapter
from fleetserve.spec.resources import DeviceClass, Fabric, Model, Node, Replica, Shard
from fleetserve.spec.yamlbounds import safe_load_all
from fleetserve.units import format_bytes


class Kind(StrEnum):
    """A kind of object the admin API lists."""

    NODES = "nodes"
    CLASSES = "classes"
    FABRICS = "fabrics"
    MODELS = "models"
    DEPLOYMENTS = "deployments"
    REPLICAS = "replicas"
    ENDPOINTS = "endpoints"
    ADAPTERS = "adapters"


ALIASES = {
    "node": Kind.NODES,
    "class": Kind.CLASSES,
    "deviceclass": Kind.CLASSES,
    "deviceclasses": Kind.CLASSES,
    "fabric": Kind.FABRICS,
    "model": Kind.MODELS,
    "deployment": Kind.DEPLOYMENTS,
    "deploy": Kind.DEPLOYMENTS,
    "replica": Kind.REPLICAS,
    "endpoint": Kind.ENDPOINTS,
    "adapter": Kind.ADAPTERS,
}


def parse_kind(text: str) -> Kind:
    """A kind from what an operator types (plural, singular or alias); ValueError names the valid ones."""
    key = text.lower()
    try:
        return ALIASES.get(key) or Kind(key)
    except ValueError:
        valid = ", ".join(k.value for k in Kind)
        raise ValueError(f"unknown kind {text!r}; valid kinds: {valid}") from None


def _devices(node: NodeView) -> str:
    counts: dict[str, int] = {}
    for device in node.devices:
        counts[device.device_class] = counts.get(device.device_class, 0) + 1
    return ", ".join(f"{n}x {c}" for c, n in counts.items()) or "-"


def engines(node: Node) -> str:
    """A node's engine builds, ``llama.cpp cpu,cuda; vllm cuda``: ``none`` where its agent found
    none, ``?`` where it never reported (placement does not filter it on engines)."""
    if node.engines is None:
        return "?"
    parts = [f"{f.engine.value} {','.join(v.value for v in f.variants) or '-'}" for f in node.engines]
    return "; ".join(parts) or "none"


def downloads(agent: AgentStatus) -> str:
    """A node's models in its agent's cache (``node.status.agent``): ready ones counted, downloads
    with their progress, failed ones with the start of their error (``describe node`` shows it
    whole)."""
    items = agent.downloads
    ready = sum(1 for d in items if d.state == "ready")
    parts = [f"{ready} ready"] if ready else []
    for item in items:
        if item.state == "downloading":
            total = item.total
            of = f"/{format_bytes(total)} {100 * item.done / total:.0f}%" if total else ""
            parts.append(f"{item.model} {format_bytes(item.done)}{of} at {format_bytes(int(item.rate))}/s")
        elif item.state == "failed":
            error = (item.error or "").replace("\n", " ")
            parts.append(f"{item.model} failed: {error[:80]}{'…' if len(error) > 80 else ''}")
    return "; ".join(parts) or "-"


def _accepted(dep: DeploymentView) -> str:
    cond = dep.status.condition(ConditionType.ACCEPTED)
    if cond is None:
        return "?"
    return "True" if cond.status else f"False ({cond.reason})"


def _shards(shards: Sequence[Shard]) -> str:
    return " + ".join(
        f"{shard.node}[{','.join(map(str, shard.devices))}]" if shard.devices else f"{shard.node} (cpu)"
        for shard in shards
    )


COLUMNS: dict[Kind, Sequence[Column]] = {
    Kind.NODES: (
        ("name", lambda n: n.name),
        ("state", lambda n: n.state),
        ("cordon", lambda n: n.cordon.reason if n.cordon else ""),
        ("devices", _devices),
        ("cpu", lambda n: f"{n.cpu.cores}c/{format_bytes(n.cpu.memory)}"),
        ("engines", engines),
        ("epoch", lambda n: n.status.epoch),
        (
            "heartbeat",
            lambda n: n.status.last_heartbeat.isoformat() if n.status.last_heartbeat else "no agent",
        ),
        ("replicas", lambda n: n.status.replicas),
        ("models", lambda n: downloads(n.status.agent)),
    ),
    Kind.CLASSES: (
        ("name", lambda c: c.name),
        ("driver", lambda c: c.driver),
        ("memory", lambda c: format_bytes(c.memory)),
    ),
    Kind.FABRICS: (("name", lambda f: f.name), ("type", lambda f: f.type)),
    Kind.MODELS: (
        ("name", lambda m: m.name),
        ("format", lambda m: m.format),
        ("size", lambda m: format_bytes(m.size) if m.size else ""),
        ("source", lambda m: m.source),
    ),
    Kind.DEPLOYMENTS: (
        ("name", lambda d: d.name),
        ("model", lambda d: d.model),
        (
            "desired",
            lambda d: d.status.desired_replicas if "desired_replicas" in d.status.model_fields_set else "",
        ),
        ("replicas", lambda d: len(d.status.replicas)),
        ("accepted", _accepted),
        ("generation", lambda d: d.generation),
    ),
    Kind.REPLICAS: (
        ("name", lambda r: r.name),
        ("deployment", lambda r: r.deployment),
        ("profile", lambda r: r.profile),
        ("state", lambda r: r.state),
        ("placement", lambda r: _shards(r.shards)),
    ),
    Kind.ENDPOINTS: (
        ("name", lambda e: e.name),
        ("url", lambda e: e.url),
        (
            "models",
            lambda e: ", ".join(
                m.name if m.name == m.upstream else f"{m.name}={m.upstream}" for m in e.models
            ),
        ),
        ("weight", lambda e: f"{e.weight:g}"),
        ("key", lambda e: e.key_file or ""),
        ("state", lambda e: e.status.state),
        ("error", lambda e: e.status.last_error or ""),
    ),
    Kind.ADAPTERS: (
        ("name", lambda a: a.name),
        ("base", lambda a: a.base),
        ("format", lambda a: a.format),
        ("source", lambda a: a.source),
    ),
}

# What ``GET /KIND`` answers, one object of it: as the CLI reads it.
VIEWS: dict[Kind, type[BaseModel]] = {
    Kind.NODES: NodeView,
    Kind.CLASSES: DeviceClass,
    Kind.FABRICS: Fabric,
    Kind.MODELS: Model,
    Kind.DEPLOYMENTS: DeploymentView,
    Kind.REPLICAS: Replica,
    Kind.ENDPOINTS: EndpointView,
    Kind.ADAPTERS: Adapter,
}
# ``GET /KIND/NAME`` where it says more than the list does.
DETAILS: dict[Kind, type[BaseModel]] = {
    **VIEWS,
    Kind.DEPLOYMENTS: DeploymentDetail,
    Kind.REPLICAS: ReplicaView,
}


def read_documents(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """Every YAML document of the files ('-' is standard input), as plain data."""
    docs: list[dict[str, Any]] = []
    problems: list[Problem] = []
    for path in paths:
        name = "<stdin>" if str(path) == "-" else str(path)
        try:
            text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
            loaded = [d for d in safe_load_all(text) if d is not None]
        except OSError as exc:
            problems.append(Problem(name, "", f"cannot read file: {exc.strerror or exc}"))
            continue
        except yaml.YAMLError as exc:
            problems.append(Problem(name, "", f"not valid YAML: {exc}"))
            continue
        for i, doc in enumerate(loaded, start=1):
            if not isinstance(doc, dict):
                problems.append(
                    Problem(f"{name} document {i}", "", "a document must be a mapping with a kind")
                )
            else:
                docs.append(doc)
    if problems:
        raise ConfigError(problems)
    if not docs:
        raise ConfigError([Problem(", ".join(map(str, paths)), "", "no documents to apply")])
    return docs


def rollout_line(data: DeploymentDetail) -> tuple[str, bool]:
    """One line of a deployment's rollout progress (from ``GET /deployments/NAME``), and whether
    the rollout is complete: the reconciler saw this generation and every replica runs its
    current revision."""
    name, status = data.name, data.status
    progress = status.rollout
    seen = status.observed_generation == data.generation
    current = progress.revision == data.revision
    if not (seen and current):
        return (f"deployment/{name}: waiting for the reconciler to see generation {data.generation}", False)
    failure = next(
        (c for c in status.conditions if c.type == ConditionType.REPLICA_FAILURE and c.status), None
    )
    counts = (
        f"{progress.updated}/{progress.desired} updated, {progress.ready} ready, "
        f"{progress.old} old, {progress.draining} draining"
    )
    if progress.complete and not progress.draining:
        return f"deployment/{name} rolled out: revision {progress.revision}, {counts}", True
    extra = f" ({failure.message})" if failure else ""
    because = {
        "model": f" (the weights of model {data.model} changed)",
        "deployment": " (the deployment changed)",
        "deployment and model": f" (the deployment and the weights of model {data.model} changed)",
    }.get(progress.cause, "")
    return f"deployment/{name}: rolling out revision {progress.revision}{because}: {counts}{extra}", False


def print_decision(data: Explanation, console: Console) -> None:
    """A stored decision (``DeploymentDecision.to_record``) as the same lines ``plan`` prints."""
    decision = data.decision
    console.print(f"[bold]deployment {data.deployment}[/]  generation {data.generation}")
    for cond in data.status.conditions:
        console.print(f"  {cond.type}={cond.status} {cond.reason}: {cond.message}", markup=False)
    if decision is None:
        console.print("  no decision recorded yet: the reconciler has not run for it")
        return
    decided = data.decided_at.isoformat() if data.decided_at else None
    console.print(f"  decided at {decided}", markup=False)
    for names, label in (
        (decision.kept, "kept"),
        (decision.lost, "on lost nodes, replaced"),
        (decision.surplus, "surplus, stopped"),
    ):
        if names:
            console.print(f"  {label}: {', '.join(names)}", markup=False)
    for placed in decision.placed:
        console.print(f"  {placed.replica}  profile {placed.profile}  {_shards(placed.shards)}", markup=False)
        for report in placed.skipped:
            console.print(f"      first tried {report.message}", markup=False)
    for unplaced in decision.unplaced:
        console.print(f"  [red]{unplaced.replica} unschedulable[/]")
        for report in unplaced.reports:
            console.print(f"      {report.message}", markup=False)
    shown = len(decision.unplaced)
    total = decision.unplaced_total if decision.unplaced_total is not None else shown
    if total > shown:
        console.print(
            f"  [red]… and {total - shown} more unschedulable[/] (the record explains the first {shown})"
        )


def waiting_enrolments(enrolments: list[EnrolmentView], since: datetime | None = None) -> list[str]:
    """The names whose latest join-token enrolment (at or after ``since``) waits for an operator's
    approval, from the admin API's ``/api/v1/enrolments``."""
    return [
        e.node
        for e in enrolments
        if e.requested_at is not None and not e.approved and (since is None or e.requested_at >= since)
    ]


def print_waiting_enrolments(enrolments: list[EnrolmentView], console: Console) -> None:
    """Below ``get nodes``: each enrolment, and each hardware claim, that waits for an operator, and
    the command that approves it."""
    by_name = {e.node: e for e in enrolments}
    for name in waiting_enrolments(enrolments):
        e = by_name[name]
        when = e.requested_at.isoformat() if e.requested_at is not None else "?"
        console.print(
            f"node {name}: an enrolment from {e.requested_from or '?'} at {when} waits "
            f"for approval: fleetserve nodes approve {name}",
            markup=False,
        )
    for e in enrolments:
        if e.claimed_hardware is not None:
            approved = e.approved_hardware.describe() if e.approved_hardware is not None else "?"
            console.print(
                f"node {e.node}: claims {e.claimed_hardware.describe()}, more than approved ({approved}); "
                f"placed with the approved hardware until: fleetserve nodes approve {e.node}",
                markup=False,
            )


def fleet_lines(fleet: FleetView) -> list[str]:
    """Below ``get nodes``: each fleet condition that is True, as ``Type: message``."""
    return [f"{c.type}: {c.message}" for c in fleet.conditions if c.status == "True"]


def emit_kind(kind: Kind, data: Any, fmt: Format, console: Console) -> None:
    """Print objects of one kind in the chosen format."""
    emit(data, fmt, console, COLUMNS[kind])
