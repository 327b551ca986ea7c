"""A sampling profiler for a running ``fleetserve server``: where its CPU goes, per phase of a run.

``bench/controlplane.py --profile DIR`` starts each server as ``python bench/stacksample.py OUT
-- server ARGS``. A daemon thread looks at every thread's Python stack (``sys._current_frames``)
every ``INTERVAL`` seconds and counts it, weighted by the CPU time that thread used since the last
look (read from the thread's own CPU clock: a thread blocked in a lock, a selector, a socket read
or a sleep weighs nothing). The CPU a thread used just before it went idle is counted on the stack
it idles in (for a worker thread, ``get``/``wait`` of its queue: the cost of the hand-over).

The benchmark marks its phases: it writes the next phase's name to ``OUT.phase`` and sends
SIGUSR1; the counts so far are written as the section just ended. Each section ``NAME`` becomes
``OUT.NAME`` (collapsed stacks, ``frame;frame;... MICROSECONDS`` a line, the format flame-graph
tools read) and ``OUT.NAME.top``: CPU per thread, per kind of work (``KINDS``: the agents'
requests, the reconciler, the assignment watch ...), and the frames under which most CPU went.

It shows the interpreter's time, not the database's; a look costs some microseconds per thread.
"""

from __future__ import annotations

import collections
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

INTERVAL = 0.01
# Kinds of work, by a frame on the stack (the first that matches), as ``.top`` files group them.
KINDS = (
    # The door's batches (``server/agents/batching.py``) run in worker threads under these frames.
    ("heartbeat (door)", "_beats (door.py"),
    ("status report (door)", "_reports (door.py"),
    ("credential check (door)", "judge ("),
    ("long-poll held (door)", "_poll (door.py"),
    ("enrolment", "register (routes.py"),
    ("credential check (middleware)", "check_agent (auth.py"),
    ("admin API", "apply (app.py"),
    ("reconciler", "run_forever (reconciler.py"),
    ("assignment watch", "assignment_inputs ("),
    ("assignment watch", "fingerprints (assignwatch.py"),
    ("gateway routes", "load (endpoints.py"),
    ("observer", "observer.py"),
    ("worker hand-over (idle after work)", "get (queue.py"),
    ("event loop: uvicorn, FastAPI, middleware", "run (runners.py"),
)


def stack_of(frame: FrameType | None) -> list[str]:
    out = []
    while frame is not None:
        code = frame.f_code
        out.append(f"{code.co_name} ({Path(code.co_filename).name}:{frame.f_lineno})")
        frame = frame.f_back
    out.reverse()
    return out


def kind_of(stack: str) -> str:
    for kind, frame in KINDS:
        if frame in stack:
            return kind
    return "other"


class Sampler:
    """Every ``INTERVAL``, each thread's stack, weighted by the CPU time the thread used since the
    last look (its own CPU clock)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.stacks: collections.Counter[str] = collections.Counter()  # stack -> CPU ns
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.phase = "start"
        self.began = time.monotonic()

    def run(self) -> None:
        me = threading.get_ident()
        names: dict[int, str] = {}
        clocks: dict[int, int] = {}
        last: dict[int, int] = {}
        while not self.stop.wait(INTERVAL):
            for t in threading.enumerate():
                if t.ident is not None and t.ident not in names:
                    names[t.ident] = t.name.split(" ")[0].split("-")[0].split("_")[0]
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                try:
                    clock = clocks.get(ident)
                    if clock is None:
                        clock = clocks[ident] = time.pthread_getcpuclockid(ident)
                    used = time.clock_gettime_ns(clock)
                except (OSError, OverflowError):
                    continue
                spent = used - last.get(ident, used)
                last[ident] = used
                if spent > 0:
                    with self.lock:
                        self.stacks[";".join([names.get(ident, "?"), *stack_of(frame)])] += spent

    def section(self, next_phase: str) -> None:
        """Write what was counted since the last mark as the current phase; start ``next_phase``."""
        with self.lock:
            stacks, self.stacks = self.stacks, collections.Counter()
            phase, self.phase = self.phase, next_phase
            wall, self.began = time.monotonic() - self.began, time.monotonic()
        out = self.out.parent / f"{self.out.name}.{phase}"
        out.write_text("".join(f"{stack} {ns // 1000}\n" for stack, ns in stacks.most_common()))
        total = sum(stacks.values()) or 1
        threads: collections.Counter[str] = collections.Counter()
        kinds: collections.Counter[str] = collections.Counter()
        inclusive: collections.Counter[str] = collections.Counter()
        for stack, ns in stacks.items():
            threads[stack.split(";", 1)[0]] += ns
            kinds[kind_of(stack)] += ns
            for frame in set(stack.split(";")):
                inclusive[frame] += ns
        with (self.out.parent / f"{out.name}.top").open("w") as f:
            f.write(
                f"phase {phase}: {wall:.0f} s, {total / 1e9:.1f} CPU-seconds in Python threads "
                f"({total / 1e9 / max(wall, 1e-9):.2f} cores)\n\nper thread:\n"
            )
            f.writelines(f"{ns / total * 100:6.1f}%  {name}\n" for name, ns in threads.most_common())
            f.write("\nper kind of work (first matching frame, bench/stacksample.py KINDS):\n")
            f.writelines(f"{ns / total * 100:6.1f}%  {name}\n" for name, ns in kinds.most_common())
            f.write("\nper frame (inclusive):\n")
            f.writelines(f"{ns / total * 100:6.1f}%  {frame}\n" for frame, ns in inclusive.most_common(200))


def main() -> None:
    out = Path(sys.argv[1])
    args = sys.argv[sys.argv.index("--") + 1 :]
    sampler = Sampler(out)
    threading.Thread(target=sampler.run, name="sampler", daemon=True).start()

    def mark(*_: object) -> None:
        try:
            phase = (out.parent / f"{out.name}.phase").read_text().strip() or "next"
        except OSError:
            phase = "next"
        threading.Thread(target=sampler.section, args=(phase,), daemon=True).start()

    signal.signal(signal.SIGUSR1, mark)
    sys.argv = ["fleetserve", *args]
    from fleetserve.cli.main import app

    try:
        app()
    finally:
        sampler.stop.set()
        sampler.section("end")


if __name__ == "__main__":
    main()
