"""``fleetserve plan``: place deployments on a fleet described in YAML, and explain every choice."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path

from rich.console import Console

from fleetserve.conditions import ConditionReason
from fleetserve.fleet import snapshot_from
from fleetserve.placement.placer import DeploymentDecision, SearchKind, plan
from fleetserve.placement.report import render_report
from fleetserve.spec.loader import load_files
from fleetserve.spec.resources import Replica
from fleetserve.units import format_bytes


class Output(StrEnum):
    """How ``plan`` prints its decisions."""

    TABLE = "table"
    JSON = "json"


def _ranges(indices: Sequence[int]) -> str:
    """Device indices compactly: (0, 1, 2, 3, 6) → ``0-3,6``."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(indices):
        if run and i != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(i)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def shards_text(replica: Replica) -> str:
    """Where a replica runs, e.g. ``hgx-01[0-7] + hgx-02[0-7] via ib-east``."""
    parts = []
    for shard in replica.shards:
        if shard.devices:
            parts.append(f"{shard.node}[{_ranges(shard.devices)}]")
        else:
            parts.append(f"{shard.node} ({shard.cpu_cores} cores, {format_bytes(shard.memory)})")
    text = " + ".join(parts)
    return f"{text} via {replica.fabric}" if replica.fabric else text


def print_table(decisions: Sequence[DeploymentDecision], console: Console) -> None:
    """Every decision, one line per replica, with every explanation under it."""
    for d in decisions:
        cond = d.accepted
        mark = "[green]Accepted[/]" if cond.status else f"[red]Not accepted: {cond.reason}[/]"
        console.print(f"\n[bold]deployment {d.deployment}[/]  desired {d.desired}  {mark}")
        if not cond.status:
            console.print(f"  {cond.message}", markup=False)
        for extra in d.conditions:
            if not extra.status and extra.reason is not ConditionReason.UNSCHEDULABLE:
                console.print(f"  {extra.type}={extra.status} {extra.reason}: {extra.message}", markup=False)
        if d.kept:
            console.print(f"  kept (already running): {', '.join(d.kept)}", markup=False)
        if d.lost:
            console.print(f"  on lost nodes, replaced: {', '.join(d.lost)}", markup=False)
        if d.surplus:
            console.print(f"  surplus, to stop: {', '.join(d.surplus)}", markup=False)
        for p in d.placed:
            r = p.replica
            scores = " ".join(f"{k}={v:g}" for k, v in p.scores.items())
            console.print(
                f"  {r.name}  profile {r.profile}  {r.device_class or 'cpu'}  {shards_text(r)}  ({scores})",
                markup=False,
            )
            for report in p.skipped:
                console.print(f"      first tried {render_report(report)}", markup=False)
        for u in d.unplaced:
            console.print(f"  [red]{u.name} unschedulable[/]")
            if not u.reports:
                console.print("      no usable profile (see the Accepted condition above)", markup=False)
            for report in u.reports:
                console.print(f"      {render_report(report)}", markup=False)


def run_plan(
    fleet: Sequence[Path], deployments: Sequence[Path], output: Output, console: Console
) -> list[DeploymentDecision]:
    """Load the files, place every deployment, print; return the decisions."""
    paths = [*fleet, *deployments]
    docs = load_files(paths)
    snapshot = snapshot_from(docs, base_dir=paths[0].parent if paths else None)
    started = time.perf_counter()
    decisions = plan(docs.deployments, snapshot, SearchKind.INDEXED)
    elapsed = time.perf_counter() - started
    if output is Output.JSON:
        console.print_json(json.dumps([d.to_dict() for d in decisions]))
    else:
        placed = sum(len(d.placed) for d in decisions)
        unplaced = sum(len(d.unplaced) for d in decisions)
        console.print(
            f"{len(snapshot.nodes)} nodes, {len(docs.deployments)} deployments: "
            f"{placed} replicas placed, {unplaced} unschedulable, in {elapsed * 1000:.1f} ms"
        )
        print_table(decisions, console)
    return decisions
