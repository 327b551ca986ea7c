"""Chaos benchmark: the multi-host lab's scenarios (tests/lab) in one run, under gateway load,
printed as a table.

Run from the repository root, as root (network namespaces)::

    .venv/bin/python bench/chaos.py

Three hosts in network namespaces on a bridge, each with a real ``fleetserve agent`` on its own
address; the server on the bridge; the tiny model with 2 replicas (a whole host each: the third
host is spare). Heartbeat deadlines are short (NotReady after 2 s, Lost after 6 s, reports every
0.5 s), as in the tests. In every scenario two clients (four in the partition) send non-streamed
chat completions and one sends streamed ones, back to back, from a second before the fault until
a second after recovery; but when most hosts are cut at once (both replicas' hosts: disruption
mode, nothing re-placed), which runs without load (no replica is reachable until the heal).

Figures per scenario: requests and streams sent / completed / failed / truncated; the slowest
non-streamed request (a connect timeout paid shows there); recovered, the seconds from the fault
until the deployment had all its replicas Running and answering again (for a partition: the
replica re-placed on another host after the Lost deadline; for most hosts cut, until both serve
again after the heal, from the engines they had); fenced, for a partition, the seconds
from the heal until the old engine on the healed host was stopped.

This prints figures; it asserts nothing (the machine may be shared and noisy).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "lab"), str(ROOT / "tests")]

import scenarios  # noqa: E402

from lab import unavailable  # noqa: E402
from load import LoadCounts  # noqa: E402


def counts(c: LoadCounts) -> str:
    return f"{c.sent}/{c.completed}/{c.failed}/{c.truncated}"


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the lab's directory (logs) after the run")
    args = parser.parse_args()
    reason = unavailable()
    if reason is not None:
        print(f"chaos: cannot run here: {reason}", file=sys.stderr)
        return 1
    runs = list(scenarios.SCENARIOS)
    skipped = []
    if not scenarios.rollout_available():
        runs.remove(scenarios.roll)
        skipped.append("roll a deployment: not run (no `fleetserve rollout` in this build)")
    workdir = Path(tempfile.mkdtemp(prefix="fleetserve-chaos-"))
    started = time.monotonic()
    lab = scenarios.start(workdir)
    results = []
    try:
        for scenario in runs:
            results.append(scenario(lab))
    finally:
        lab.close()
    header = (
        f"{'scenario':<20} {'requests s/c/f/t':>17} {'streams s/c/f/t':>16} {'slowest s':>10} "
        f"{'recovered s':>12} {'fenced s':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        slowest = r.timing.slowest
        print(
            f"{r.name:<20} {counts(r.requests):>17} {counts(r.streams):>16} {slowest:>10.2f} "
            f"{seconds(r.recovered):>12} {seconds(r.fenced):>9}"
        )
    for r in results:
        for note in r.notes:
            print(f"  {r.name}: {note}")
        if r.max_engines_per_replica > 1:
            print(f"  {r.name}: {r.max_engines_per_replica} engines served one replica at once")
    for line in skipped:
        print(f"  {line}")
    print(
        f"(s/c/f/t: sent/completed/failed/truncated; {scenarios.HOSTS} hosts, {scenarios.REPLICAS} "
        f"replicas; whole run {time.monotonic() - started:.0f} s; lab in {workdir})"
    )
    if not args.keep:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
