"""How the admin CLI shows API objects: kinds, table columns, decisions; reading YAML to apply."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from fleetserve.cli.output import Column, Format, emit
from fleetserve.conditions import ConditionType
from fleetserve.errors import ConfigError, Problem
from fleetserve.units import format_bytes


class Kind(StrEnum):
    """A kind of object the admin API lists."""

    NODES = "nodes"
    CLASSES = "classes"
    FABRICS = "fabrics"
    MODELS = "models"
    DEPLOYMENTS = "deployments"
    REPLICAS = "replicas"


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
}


def parse_kind(text: str) -> Kind:
    """A kind from what an operator types (plural, singular or alias); ValueError names the valid ones."""
    key = text.lower()
    try:
        return ALIASES.get(key) or Kind(key)
    except ValueError:
        valid = ", ".join(k.value for k in Kind)
        raise ValueError(f"unknown kind {text!r}; valid kinds: {valid}") from None


def _devices(node: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for device in node.get("devices", []):
        counts[device["class"]] = counts.get(device["class"], 0) + 1
    return ", ".join(f"{n}x {c}" for c, n in counts.items()) or "-"


def downloads(node: dict[str, Any]) -> str:
    """The node's models in its agent's cache: ready ones counted, downloads with their progress,
    failed ones with the start of their error (``describe node`` shows it whole)."""
    items = node.get("status", {}).get("agent", {}).get("downloads", [])
    ready = sum(1 for d in items if d.get("state") == "ready")
    parts = [f"{ready} ready"] if ready else []
    for item in items:
        state, done, total = item.get("state"), int(item.get("done", 0)), item.get("total")
        if state == "downloading":
            of = f"/{format_bytes(int(total))} {100 * done / total:.0f}%" if total else ""
            parts.append(
                f"{item['model']} {format_bytes(done)}{of} at {format_bytes(int(item.get('rate', 0)))}/s"
            )
        elif state == "failed":
            error = (item.get("error") or "").replace("\n", " ")
            parts.append(f"{item['model']} failed: {error[:80]}{'…' if len(error) > 80 else ''}")
    return "; ".join(parts) or "-"


def _accepted(dep: dict[str, Any]) -> str:
    for cond in dep.get("status", {}).get("conditions", []):
        if cond["type"] == ConditionType.ACCEPTED:
            return "True" if cond["status"] else f"False ({cond['reason']})"
    return "?"


def _shards(replica: dict[str, Any]) -> str:
    parts = []
    for shard in replica.get("shards", []):
        devices = shard.get("devices") or []
        parts.append(
            f"{shard['node']}[{','.join(map(str, devices))}]" if devices else f"{shard['node']} (cpu)"
        )
    return " + ".join(parts)


COLUMNS: dict[Kind, Sequence[Column]] = {
    Kind.NODES: (
        ("name", lambda n: n["name"]),
        ("state", lambda n: n["state"]),
        ("cordon", lambda n: (n.get("cordon") or {}).get("reason", "")),
        ("devices", _devices),
        ("cpu", lambda n: f"{n['cpu']['cores']}c/{format_bytes(n['cpu']['memory'])}"),
        ("epoch", lambda n: n["status"]["epoch"]),
        ("heartbeat", lambda n: n["status"]["lastHeartbeat"] or "no agent"),
        ("replicas", lambda n: n["status"]["replicas"]),
        ("models", downloads),
    ),
    Kind.CLASSES: (
        ("name", lambda c: c["name"]),
        ("driver", lambda c: c["driver"]),
        ("memory", lambda c: format_bytes(c["memory"])),
    ),
    Kind.FABRICS: (("name", lambda f: f["name"]), ("type", lambda f: f["type"])),
    Kind.MODELS: (
        ("name", lambda m: m["name"]),
        ("format", lambda m: m["format"]),
        ("size", lambda m: format_bytes(m["size"]) if m.get("size") else ""),
        ("source", lambda m: m.get("source", "")),
    ),
    Kind.DEPLOYMENTS: (
        ("name", lambda d: d["name"]),
        ("model", lambda d: d["model"]),
        ("desired", lambda d: d.get("status", {}).get("desiredReplicas", "")),
        ("replicas", lambda d: len(d.get("status", {}).get("replicas", []))),
        ("accepted", _accepted),
        ("generation", lambda d: d["generation"]),
    ),
    Kind.REPLICAS: (
        ("name", lambda r: r["name"]),
        ("deployment", lambda r: r["deployment"]),
        ("profile", lambda r: r["profile"]),
        ("state", lambda r: r["state"]),
        ("placement", _shards),
    ),
}


def read_documents(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """Every YAML document of the files ('-' is standard input), as plain data."""
    docs: list[dict[str, Any]] = []
    problems: list[Problem] = []
    for path in paths:
        name = "<stdin>" if str(path) == "-" else str(path)
        try:
            text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
            loaded = [d for d in yaml.safe_load_all(text) if d is not None]
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


def rollout_line(data: dict[str, Any]) -> tuple[str, bool]:
    """One line of a deployment's rollout progress (from ``GET /deployments/NAME``), and whether
    the rollout is complete: the reconciler saw this generation and every replica runs its
    current revision."""
    name, status = data["name"], data.get("status", {})
    progress = status.get("rollout") or {}
    seen = status.get("observedGeneration") == data.get("generation")
    current = progress.get("revision") == data.get("revision")
    if not (seen and current):
        return (
            f"deployment/{name}: waiting for the reconciler to see generation {data.get('generation')}",
            False,
        )
    failure = next(
        (
            c
            for c in status.get("conditions", [])
            if c["type"] == ConditionType.REPLICA_FAILURE and c["status"]
        ),
        None,
    )
    counts = (
        f"{progress['updated']}/{progress['desired']} updated, {progress['ready']} ready, "
        f"{progress['old']} old, {progress['draining']} draining"
    )
    if progress.get("complete") and not progress.get("draining"):
        return f"deployment/{name} rolled out: revision {progress['revision']}, {counts}", True
    extra = f" ({failure['message']})" if failure else ""
    return f"deployment/{name}: rolling out revision {progress['revision']}: {counts}{extra}", False


def print_decision(data: dict[str, Any], console: Console) -> None:
    """A stored decision (``DeploymentDecision.to_dict``) as the same lines ``plan`` prints."""
    decision = data.get("decision")
    status = data.get("status") or {}
    console.print(f"[bold]deployment {data['deployment']}[/]  generation {data.get('generation')}")
    for cond in status.get("conditions", []):
        console.print(
            f"  {cond['type']}={cond['status']} {cond['reason']}: {cond.get('message', '')}", markup=False
        )
    if decision is None:
        console.print("  no decision recorded yet: the reconciler has not run for it")
        return
    console.print(f"  decided at {data.get('decidedAt')}", markup=False)
    for key, label in (
        ("kept", "kept"),
        ("lost", "on lost nodes, replaced"),
        ("surplus", "surplus, stopped"),
    ):
        if decision.get(key):
            console.print(f"  {label}: {', '.join(decision[key])}", markup=False)
    for placed in decision.get("placed", []):
        console.print(f"  {placed['replica']}  profile {placed['profile']}  {_shards(placed)}", markup=False)
        for report in placed.get("skipped", []):
            console.print(f"      first tried {report['message']}", markup=False)
    unplaced_list = decision.get("unplaced", [])
    for unplaced in unplaced_list:
        console.print(f"  [red]{unplaced['replica']} unschedulable[/]")
        for report in unplaced.get("reports", []):
            console.print(f"      {report['message']}", markup=False)
    more = decision.get("unplacedTotal", len(unplaced_list)) - len(unplaced_list)
    if more > 0:
        shown = len(unplaced_list)
        console.print(f"  [red]… and {more} more unschedulable[/] (the record explains the first {shown})")


def waiting_enrolments(enrolments: list[dict[str, Any]], since: datetime | None = None) -> list[str]:
    """The names whose latest join-token enrolment (at or after ``since``) waits for an operator's
    approval, from the admin API's ``/api/v1/enrolments``."""
    return [
        e["node"]
        for e in enrolments
        if e.get("requestedAt")
        and not e.get("approved")
        and (since is None or datetime.fromisoformat(e["requestedAt"]) >= since)
    ]


def print_waiting_enrolments(enrolments: list[dict[str, Any]], console: Console) -> None:
    """Below ``get nodes``: each enrolment that waits for an operator, and the command that approves it."""
    by_name = {e["node"]: e for e in enrolments}
    for name in waiting_enrolments(enrolments):
        e = by_name[name]
        console.print(
            f"node {name}: an enrolment from {e.get('requestedFrom') or '?'} at {e['requestedAt']} waits "
            f"for approval: fleetserve nodes approve {name}",
            markup=False,
        )


def emit_kind(kind: Kind, data: Any, fmt: Format, console: Console) -> None:
    """Print objects of one kind in the chosen format."""
    emit(data, fmt, console, COLUMNS[kind])
