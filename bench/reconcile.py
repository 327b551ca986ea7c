"""Reconcile-cycle benchmark: ``Reconciler.run_once`` in process, against a real store.

Run from the repository root (PostgreSQL on 127.0.0.1:5432 with trust auth, as the tests use)::

    .venv/bin/python bench/reconcile.py                   # 5,000 nodes, 50,000 desired replicas
    .venv/bin/python bench/reconcile.py --quick           # 300 nodes, 3,000 desired replicas
    .venv/bin/python bench/reconcile.py --baseline main   # and main's reconciler, same run

Columns: ``sqlite`` (a file in a temporary directory) and ``postgres`` (a database
``fleetserve_bench_<pid>_<n>`` it creates and drops), each run in a fresh child process (so its
RSS is its own); with ``--baseline REF`` the same two again with the package of a git ref (a
temporary ``git worktree``, first on the child's PYTHONPATH), side by side in one table.

The fleet and the deployments are the placement benchmark's (``bench/placement.py``'s
``build_snapshot``, and its seeded mix of eight deployments, as ``bench/controlplane.py`` splits
them): every node is registered in the store (about 1% cordoned, 1% NotReady), the classes,
fabrics, models and deployments applied. The desired replicas are more than the fleet holds, so
a steady cycle still explains the replicas that do not fit.

Phases, per column (the reconciler's clock is simulated: one second per cycle):

- **fill**: cycles until one allocates, drains and releases nothing; between cycles every new
  replica is reported Running and every node heartbeats, as agents would (not timed).
- **steady**: ``--cycles`` cycles with nothing changed but the heartbeats, each read and planned
  in full (``Reconciler.quiet_cycles`` off): p50/p99 of the cycle and of each phase (snapshot,
  plan, commit), RSS at the first and the last.
- **quiet**: ``--cycles`` more such cycles as the server runs them: a cycle that finds nothing
  changed since one that changed nothing reads and plans nothing (how many were, and their
  p50/p99; a ref without quiet cycles reads in full every time).
- **one change**: a cycle after each of: one deployment scaled by -10 (its Running replicas
  start to drain); the drain deadline passing (they are released, and other deployments' waiting
  replicas take the room); the same deployment scaled by +10 again; one node silent past the
  NotReady deadline; one node silent past the Lost deadline (its replicas released and
  replaced where there is room).

Each column sets the cyclic garbage collector's thresholds as ``fleetserve server`` does in its
ref (``server/collector.py``'s ``tune_collector``, where the ref has one; the table shows them).

This prints figures; it asserts nothing (the machine may be shared and noisy).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import controlplane
import placement as fleetgen

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("snapshot", "plan", "commit")


def rss_mib() -> float:
    """This process's resident set now, in MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


class Clock:
    """The reconciler's wall clock, moved by the benchmark."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


class Agents:
    """What the fleet's agents would write between cycles, in bulk: heartbeats and Running."""

    def __init__(self, url: str) -> None:
        from fleetserve.store.db import make_engine

        self.engine = make_engine(url)

    def tick(self, now: datetime, silent: dict[str, datetime]) -> None:
        """Every node heartbeats at ``now`` (a silent one keeps the heartbeat it is given); every
        Pending replica is reported Running."""
        from sqlalchemy import update

        from fleetserve.store.tables import NodeRow, ReplicaRow, stamp

        with self.engine.begin() as conn:
            conn.execute(update(NodeRow).values(last_heartbeat=stamp(now)))
            for name, last in silent.items():
                conn.execute(update(NodeRow).where(NodeRow.name == name).values(last_heartbeat=stamp(last)))
            conn.execute(update(ReplicaRow).where(ReplicaRow.state == "Pending").values(state="Running"))

    def close(self) -> None:
        self.engine.dispose()


def populate(store: Any, snapshot: Any, replicas: int, seed: int) -> None:
    """Classes, fabrics, models, every node and the deployments, applied as documents."""
    from fleetserve.spec.loader import Documents, parse_document
    from fleetserve.spec.resources import NodeState

    docs = Documents()
    raw = controlplane.write_documents(snapshot) + controlplane.deployment_docs(snapshot, replicas, seed)
    for i, d in enumerate(raw):
        docs.add(parse_document(d, f"doc {i}"))
    for node in snapshot.nodes:
        docs.add(node)
    store.apply_documents(docs)
    for node in snapshot.nodes:
        if node.state is not NodeState.READY:
            store.set_state(node.name, node.state)


def worker(kind: str, url: str, args: argparse.Namespace) -> dict[str, Any]:
    """One column: fill, steady cycles and single changes; its figures."""
    from fleetserve.server.reconciler.loop import Reconciler
    from fleetserve.spec.resources import NodeState
    from fleetserve.store.sql import SqlStore

    out: dict[str, Any] = {}
    # The collector as the server process sets it (``fleetserve server``), where the ref does.
    try:
        from fleetserve.server.collector import tune_collector
    except ImportError:  # a ref from before the setting: the collector's defaults
        pass
    else:
        tune_collector()
    out["gc thresholds"] = list(gc.get_threshold())
    snapshot = fleetgen.build_snapshot(args.nodes, args.gpus, fleetgen.MODELS, args.seed)
    store = SqlStore.open(url)
    agents = Agents(url)
    clock = Clock()
    silent: dict[str, datetime] = {}
    try:
        began = time.perf_counter()
        populate(store, snapshot, args.replicas, args.seed)
        out["populate s"] = time.perf_counter() - began
        reconciler = Reconciler(store, clock=clock)

        def cycle() -> Any:
            agents.tick(clock.now, silent)
            clock.advance(1)
            return reconciler.run_once()

        # Fill: until a cycle changes nothing.
        began = time.perf_counter()
        fill_cycles = 0
        placed = 0
        while fill_cycles < args.max_fill:
            result = cycle()
            fill_cycles += 1
            placed += len(result.allocated)
            if not (result.allocated or result.released or result.draining or result.transitions):
                break
        out["fill s"] = time.perf_counter() - began
        out["fill cycles"] = fill_cycles
        out["replicas placed"] = len(store.replicas())
        gc.collect()

        steady: list[Any] = []
        rss: list[float] = []
        watch = fleetgen.GcWatch()  # full (generation 2) collections: a pause inside some cycle
        gc.callbacks.append(watch)
        reconciler.quiet_cycles = False
        for _ in range(args.cycles):
            steady.append(cycle())
            rss.append(rss_mib())
        gc.callbacks.remove(watch)
        reconciler.quiet_cycles = True
        quiet = [cycle() for _ in range(args.cycles)]
        out["quiet"] = [r.seconds for r in quiet if getattr(r, "quiet", False)]
        out["full gc"] = [watch.passes, watch.total_s, watch.longest_s]
        out["steady"] = {
            "cycle": [r.seconds for r in steady],
            **{p: [r.phases[p] for r in steady if p in r.phases] for p in PHASES},
        }
        out["rss"] = [rss[0], rss[-1]]
        out["steady changes"] = sum(len(r.allocated) + len(r.released) + len(r.draining) for r in steady)

        events: dict[str, Any] = {}

        def event(label: str, change: Callable[[], None], advance: float = 0.0) -> None:
            change()
            clock.advance(advance)
            r = cycle()
            events[label] = {
                "seconds": r.seconds,
                "phases": {p: r.phases.get(p, 0.0) for p in PHASES},
                "did": f"+{len(r.allocated)} -{len(r.released)} ~{len(r.draining)} t{len(r.transitions)}",
            }

        stored = {d.deployment.name: d.deployment for d in store.list_deployments()}
        # A deployment whose replicas all fit (so -10 drains Running ones), else the first.
        counts: dict[str, int] = {}
        for r in store.replicas():
            counts[r.deployment] = counts.get(r.deployment, 0) + 1
        target = next(
            (n for n, d in stored.items() if counts.get(n, 0) >= d.desired_replicas >= 10),
            max(stored, key=lambda n: counts.get(n, 0)),
        )
        dep = stored[target]
        down = dep.model_copy(update={"replicas": dep.desired_replicas - 10})
        event("scale -10 (drain)", lambda: store.put_deployment(down))
        event("drain deadline passed", lambda: None, advance=dep.drain_seconds + 1)
        event("scale +10", lambda: store.put_deployment(dep))
        holders = sorted({s.node for r in store.replicas() for s in r.shards})
        ready = [h.name for h in store.node_heartbeats() if h.state is NodeState.READY]
        victims = [n for n in holders if n in set(ready)][:2]
        policy = reconciler.policy
        silences = (("one node NotReady", policy.not_ready_after), ("one node Lost", policy.lost_after))
        for (label, after), victim in zip(silences, victims, strict=False):
            last = clock.now - after - timedelta(seconds=1)
            event(label, lambda victim=victim, last=last: silent.__setitem__(victim, last))
        out["events"] = events
        out["event target"] = f"{target} ({dep.desired_replicas} replicas), nodes {', '.join(victims)}"
    finally:
        agents.close()
        store.close()
    return out


def quantile(values: Sequence[float], q: float) -> float:
    return fleetgen.percentile(sorted(values), q)


def rows(fig: dict[str, Any]) -> dict[str, str]:
    """A column's figures as table cells."""
    if "error" in fig:
        return {"fill": f"failed: {fig['error']}"}
    out = {
        "GC thresholds (as the server sets)": "/".join(str(t) for t in fig["gc thresholds"]),
        "populate s": f"{fig['populate s']:.1f}",
        "fill: cycles, s": f"{fig['fill cycles']}, {fig['fill s']:.1f}",
        "replicas placed": f"{fig['replicas placed']:,}",
    }
    steady = fig["steady"]
    for name in ("cycle", *PHASES):
        values = steady.get(name) or [0.0]
        label = "steady cycle p50 / p99 s" if name == "cycle" else f"  {name} p50 / p99 s"
        out[label] = f"{quantile(values, 50):.3f} / {quantile(values, 99):.3f}"
    out["  changes in steady cycles"] = str(fig["steady changes"])
    quiet = fig["quiet"]
    out["quiet cycles: of steady, p50 / p99 ms"] = f"{len(quiet)} of {len(fig['steady']['cycle'])}, " + (
        f"{quantile(quiet, 50) * 1e3:.1f} / {quantile(quiet, 99) * 1e3:.1f}" if quiet else "-"
    )
    out["RSS MiB first / last cycle"] = f"{fig['rss'][0]:,.0f} / {fig['rss'][1]:,.0f}"
    passes, total, longest = fig["full gc"]
    out["  full GC passes, s (longest)"] = f"{passes}, {total:.2f} ({longest:.2f})"
    for label, e in fig["events"].items():
        p = e["phases"]
        out[f"{label}: s"] = f"{e['seconds']:.3f}"
        out[f"  {label}: split"] = f"{p['snapshot']:.2f}/{p['plan']:.2f}/{p['commit']:.2f} {e['did']}"
    return out


def table(columns: Sequence[tuple[str, dict[str, str]]]) -> list[str]:
    names: list[str] = []
    for _, c in columns:
        names += [n for n in c if n not in names]
    width = max(len(n) for n in names)
    widths = [max(len(label), *(len(v) for v in c.values())) for label, c in columns]
    lines = [" " * width + "".join(f"  {label:>{w}}" for (label, _), w in zip(columns, widths, strict=True))]
    for n in names:
        lines.append(
            f"{n:<{width}}"
            + "".join(f"  {c.get(n, '-'):>{w}}" for (_, c), w in zip(columns, widths, strict=True))
        )
    return lines


def run_column(kind: str, src: Path | None, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One column in a child process (``src``: another checkout's package first, driven by that
    checkout's own worker, so a module moved since that ref is imported where the ref has it)."""
    env = dict(os.environ)
    script = Path(__file__).resolve()
    if src is not None:
        env["PYTHONPATH"] = str(src)
        script = src.parent / "bench" / script.name
    result = tmp / f"{kind}-{'base' if src else 'this'}.json"
    argv = [sys.executable, str(script), "--worker", kind, "--json", str(result)]
    argv += ["--nodes", str(args.nodes), "--gpus", str(args.gpus), "--replicas", str(args.replicas)]
    argv += ["--cycles", str(args.cycles), "--seed", str(args.seed), "--max-fill", str(args.max_fill)]
    done = subprocess.run(argv, env=env, cwd=tmp, check=False)
    if done.returncode != 0 or not result.exists():
        return {"error": f"exit {done.returncode}"}
    data: dict[str, Any] = json.loads(result.read_text())
    return data


def worker_main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="fleetserve-bench-rc-") as tmp:
        if args.worker == "postgres":
            url, drop = controlplane.create_database()
        else:
            url, drop = f"sqlite:///{Path(tmp) / 'state.db'}", (lambda: None)
        try:
            figures = worker(args.worker, url, args)
        finally:
            drop()
    Path(args.json).write_text(json.dumps(figures))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small run: 300 nodes, 3,000 replicas")
    parser.add_argument("--nodes", type=int, help="nodes in the fleet, CPU-only ones included (5000)")
    parser.add_argument("--gpus", type=int, help="GPUs in the fleet (8 per node)")
    parser.add_argument("--replicas", type=int, help="desired replicas over every deployment (10 per node)")
    parser.add_argument("--cycles", type=int, help="steady cycles timed (10; quick 5)")
    parser.add_argument("--max-fill", type=int, default=30, help="at most this many fill cycles (30)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the fleet and the workload (1)")
    parser.add_argument("--skip", default="", help="comma-separated columns to leave out: sqlite, postgres")
    parser.add_argument(
        "--baseline", metavar="REF", help="also run the reconciler of this git ref (e.g. main), same run"
    )
    parser.add_argument("--worker", choices=("sqlite", "postgres"), help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.nodes = args.nodes or (300 if args.quick else 5000)
    args.gpus = args.gpus or 8 * args.nodes
    args.replicas = args.replicas or 10 * args.nodes
    args.cycles = args.cycles or (5 if args.quick else 10)
    if args.worker:
        return worker_main(args)
    kinds = [k for k in ("sqlite", "postgres") if k not in {s.strip() for s in args.skip.split(",")}]
    print(
        f"fleetserve reconcile benchmark (seed {args.seed}{', quick' if args.quick else ''}): "
        f"{args.nodes:,} nodes, {args.gpus:,} GPUs, {args.replicas:,} desired replicas; "
        f"{args.cycles} steady cycles per column",
        flush=True,
    )
    columns: list[tuple[str, dict[str, str]]] = []
    targets: list[str] = []
    with tempfile.TemporaryDirectory(prefix="fleetserve-bench-rc-") as tmp_name:
        tmp = Path(tmp_name)
        base_src = None
        if args.baseline:
            base_src = controlplane.baseline_checkout(args.baseline, tmp / "baseline")
        try:
            for kind in kinds:
                plan: list[tuple[str, Path | None]] = [(kind, None)]
                if base_src is not None:
                    plan.insert(0, (f"{kind} @{args.baseline}", base_src))
                for label, src in plan:
                    print(f"  [{label}] ...", file=sys.stderr, flush=True)
                    fig = run_column(kind, src, args, tmp)
                    columns.append((label, rows(fig)))
                    if "event target" in fig:
                        targets.append(f"{label}: {fig['event target']}")
        finally:
            if base_src is not None:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmp / "baseline")],
                    check=False,
                )
    print()
    for line in table(columns):
        print(line)
    print(
        "\nsteady: cycles with only heartbeats changed (full GC: the cyclic collector's generation-2 "
        "passes during them, inside the cycle times); one change: the cycle right after it (did: "
        "+allocated -released ~draining t node transitions);\nchanged: "
        + "; ".join(targets)
        + "\ntarget: a cycle <= 1 s at 5,000 nodes and 50,000 replicas, RSS flat over cycles"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
