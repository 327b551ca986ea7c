"""The reconciler in a process of its own, supervised by the server (``fleetserve server`` on
PostgreSQL; ``--reconciler``).

Why: at 5,000 nodes a full reconcile cycle is most of a second of CPU, and its snapshot and kept
free capacity are most of the heap. In the server process both were paid for by the agents'
heartbeats: one interpreter runs one thread at a time, and each collection of that heap stalls
every thread. In a process of its own the reconciler has its own interpreter, heap and collector,
and the server process answers the fleet with a core to itself.

What crosses the boundary is typed, JSON over a pipe, validated on arrival (``ToServer``,
``ToReconciler``):

- reconciler → server, ``Ask``: the autoscaler's ``SignalsQuery`` for one deployment; the server
  answers from its observer (engine load) and gateway (held requests, last request) — the same
  function that answers a reconciler thread (``signals.signal_answers``).
- reconciler → server, ``Cycle``: each cycle's ``CycleFigures``, which the server records on its
  ``/metrics`` as a reconciler thread's are.
- server → reconciler, ``Stop``: end after the cycle in progress, hand the lease over, exit.

The server starts the child with ``spawn`` (a fresh interpreter, not a fork of a process running
threads) and gives it the database URL through multiprocessing's pipe, never its argv. The child
holds the lease under its server's name (``host:pid`` of the server), so operators read which
server reconciles. A child that exits unasked is started again (after 1 s, doubling to 30 s while
it keeps failing within a minute), and said so in the log; under the same name, it leads at once.
On shutdown the server sends ``Stop``, waits for the cycle in progress to end, then terminates it.
The child ignores SIGINT (a Ctrl-C at a terminal reaches the whole process group; the server
decides when its reconciler stops), takes SIGTERM as ``Stop``, and on Linux is sent SIGTERM by the
kernel when the server dies (``PR_SET_PDEATHSIG``); anywhere, a closed pipe stops it.

SQLite keeps the reconciler on a thread of the server: its file has one writer at a time, and a
second process would wait on the file's lock where a thread waits on the server's own.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from fleetserve.autoscale import Signals, SignalsQuery
from fleetserve.errors import FleetserveError
from fleetserve.metrics.exposition import FleetMetrics
from fleetserve.reconcile.health import HeartbeatPolicy
from fleetserve.server.collector import tune_collector
from fleetserve.server.reconciler.loop import CycleFigures, CycleResult, Reconciler
from fleetserve.spec.resources import Deployment, Replica

log = logging.getLogger("fleetserve.reconciler")

# How long the reconciler waits for the server to answer the autoscaler's question.
ANSWER_SECONDS = 10.0
# Restarts of a child that keeps exiting unasked: the first wait, the longest, and how long a
# child must have run for the next failure to start from the first wait again.
RESTART_FIRST_SECONDS = 1.0
RESTART_MAX_SECONDS = 30.0
RESTART_RESET_SECONDS = 60.0
_PR_SET_PDEATHSIG = 1


class ReconcilerLinkError(FleetserveError):
    """The reconciler process and its server could not reach each other."""


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Ask(_Message):
    """The autoscaler's question about one deployment, numbered so a late answer is not taken for
    the next question's."""

    kind: Literal["ask"] = "ask"
    seq: int
    query: SignalsQuery


class Cycle(_Message):
    """What a cycle tells ``/metrics``."""

    kind: Literal["cycle"] = "cycle"
    figures: CycleFigures


class Answer(_Message):
    """The server's answer to ``Ask`` number ``seq``: the signals, or why there are none."""

    kind: Literal["answer"] = "answer"
    seq: int
    signals: Signals | None = None
    error: str | None = None


class Stop(_Message):
    """End after the cycle in progress, hand the lease over, exit."""

    kind: Literal["stop"] = "stop"


ToServer: TypeAdapter[Ask | Cycle] = TypeAdapter(Annotated[Ask | Cycle, Field(discriminator="kind")])
ToReconciler: TypeAdapter[Answer | Stop] = TypeAdapter(Annotated[Answer | Stop, Field(discriminator="kind")])


@dataclass(frozen=True)
class ReconcilerConfig:
    """What the child needs to run the reconciler (pickled through multiprocessing's pipe)."""

    database_url: str
    interval: float
    policy: HeartbeatPolicy
    # The lease holder's name: the server's (``holder_name()`` in the server process), so operators
    # and ``fleetserve`` read which server reconciles; a child started again after a crash takes
    # the lease its predecessor held at once, that one being gone.
    holder: str
    log_level: str = "info"


def _send(conn: Connection, lock: threading.Lock, message: _Message) -> None:
    data = message.model_dump_json().encode()
    with lock:
        conn.send_bytes(data)


# --- the child ---------------------------------------------------------------------------------


class _ServerLink:
    """The child's side of the pipe: a thread receives (answers, Stop, the pipe closing); the
    reconciler's thread asks and sends."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.stop = threading.Event()
        self._answers: queue.Queue[Answer | None] = queue.Queue()
        self._lock = threading.Lock()
        self._seq = itertools.count(1)

    def receive_forever(self) -> None:
        while True:
            try:
                message = ToReconciler.validate_json(self.conn.recv_bytes())
            except (EOFError, OSError):
                log.warning("the server closed the reconciler's pipe: stopping")
                self.stop.set()
                self._answers.put(None)
                return
            except ValidationError as exc:
                log.error("a message from the server that is not one (ignored): %s", exc)
                continue
            if isinstance(message, Stop):
                self.stop.set()
            else:
                self._answers.put(message)

    def signals(self, dep: Deployment, replicas: list[Replica], now: float) -> Signals:
        """Ask the server what the autoscaler sees of ``dep`` (a ``SignalSource``)."""
        seq = next(self._seq)
        try:
            _send(self.conn, self._lock, Ask(seq=seq, query=SignalsQuery.of(dep, replicas, now)))
        except OSError as exc:
            raise ReconcilerLinkError(f"cannot ask the server about {dep.name}: {exc}") from exc
        deadline = time.monotonic() + ANSWER_SECONDS
        while True:
            try:
                answer = self._answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ReconcilerLinkError(
                    f"the server did not answer the autoscaler's question about {dep.name} "
                    f"within {ANSWER_SECONDS:.0f} s"
                ) from None
            if answer is None:
                self._answers.put(None)  # for whoever asks next
                raise ReconcilerLinkError("the server went away")
            if answer.seq != seq:
                continue  # the late answer to a question that timed out
            if answer.signals is None:
                raise ReconcilerLinkError(f"the server could not answer about {dep.name}: {answer.error}")
            return answer.signals

    def send_cycle(self, result: CycleResult) -> None:
        try:
            _send(self.conn, self._lock, Cycle(figures=result.figures()))
        except OSError:
            self.stop.set()  # the server is gone; the receiving thread says so


def _stop_with_parent() -> None:
    """Have the kernel send SIGTERM when the server process dies (Linux; elsewhere the pipe closing
    stops the child)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG): %s", os.strerror(ctypes.get_errno()))


def child_main(config: ReconcilerConfig, conn: Connection) -> None:
    """The reconciler process: cycle until told to stop, the server is gone, or SIGTERM."""
    from fleetserve.store.sql import SqlStore

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    _stop_with_parent()
    link = _ServerLink(conn)
    signal.signal(signal.SIGTERM, lambda _sig, _frame: link.stop.set())
    threading.Thread(target=link.receive_forever, name="server-link", daemon=True).start()
    tune_collector()
    try:
        store = SqlStore.open(config.database_url, migrate_schema=False)
    except FleetserveError as exc:
        log.error("the reconciler process cannot open the store: %s", exc)
        raise SystemExit(2) from None
    try:
        reconciler = Reconciler(store, policy=config.policy, holder=config.holder, signals=link.signals)
        log.info("reconciler process %d: cycling every %.2f s", os.getpid(), config.interval)
        reconciler.run_forever(link.stop, config.interval, on_cycle=link.send_cycle)
    finally:
        store.close()


# --- the server's side -------------------------------------------------------------------------


class ReconcilerProcess:
    """Starts the reconciler process, answers it, records its cycles, restarts it when it exits
    unasked, and stops it (module docstring)."""

    def __init__(
        self,
        config: ReconcilerConfig,
        answer: Callable[[SignalsQuery], Signals],
        metrics: FleetMetrics | None = None,
        target: Callable[[ReconcilerConfig, Connection], None] = child_main,
    ) -> None:
        self.config = config
        self.answer = answer
        self.metrics = metrics
        self.target = target
        self._context = multiprocessing.get_context("spawn")
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # guards _conn and _process, and orders sends on the pipe
        self._conn: Connection | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._thread: threading.Thread | None = None
        # For tests and the curious: children started, cycles recorded, the last figures.
        self.starts = 0
        self.cycles = 0
        self.last: CycleFigures | None = None

    @property
    def pid(self) -> int | None:
        """The running child's process id (None between children)."""
        with self._lock:
            process = self._process
        return process.pid if process is not None and process.is_alive() else None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the reconciler process was started already")
        # The thread that starts the children outlives each one: PR_SET_PDEATHSIG follows it.
        self._thread = threading.Thread(target=self._supervise, name="reconciler-supervisor", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Ask the child to stop after its cycle and wait up to ``timeout`` s; then terminate it."""
        self._stopping.set()
        with self._lock:
            process = self._process
            self._tell_stop()
        if self._thread is not None:
            self._thread.join(timeout)
        if process is not None and process.is_alive():
            log.warning("the reconciler process did not stop within %.0f s: terminating it", timeout)
            process.terminate()
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)

    def _tell_stop(self) -> None:
        # Called with the lock held.
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.send_bytes(Stop().model_dump_json().encode())

    def _supervise(self) -> None:
        wait = RESTART_FIRST_SECONDS
        while not self._stopping.is_set():
            began = time.monotonic()
            code = self._run_child()
            if self._stopping.is_set():
                break
            if time.monotonic() - began >= RESTART_RESET_SECONDS:
                wait = RESTART_FIRST_SECONDS
            log.error(
                "the reconciler process exited unasked (exit status %s); starting another in %.0f s",
                code,
                wait,
            )
            self._stopping.wait(wait)
            wait = min(wait * 2, RESTART_MAX_SECONDS)

    def _run_child(self) -> int | None:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(
            target=self.target, args=(self.config, theirs), name="fleetserve-reconciler", daemon=True
        )
        try:
            process.start()
        finally:
            theirs.close()
        with self._lock:
            self._conn, self._process = ours, process
            self.starts += 1
            if self._stopping.is_set():
                self._tell_stop()
        try:
            self._serve(ours, process)
        finally:
            with self._lock:
                self._conn = None
            ours.close()
            process.join(10)
            if process.is_alive():  # its pipe closed but it goes on: it is not ours to keep
                process.kill()
                process.join(5)
        return process.exitcode

    def _serve(self, conn: Connection, process: multiprocessing.process.BaseProcess) -> None:
        """Answer and record the child's messages until its pipe closes."""
        while True:
            try:
                if not conn.poll(0.5):
                    if not process.is_alive():
                        return
                    continue
                data = conn.recv_bytes()
            except (EOFError, OSError):
                return
            try:
                message = ToServer.validate_json(data)
            except ValidationError as exc:
                log.error("a message from the reconciler process that is not one (ignored): %s", exc)
                continue
            if isinstance(message, Cycle):
                self.cycles += 1
                self.last = message.figures
                if self.metrics is not None:
                    message.figures.record(self.metrics)
                continue
            try:
                reply = Answer(seq=message.seq, signals=self.answer(message.query))
            except Exception as exc:  # the child's cycle fails with it, and says why
                log.exception("answering the autoscaler about %s", message.query.deployment)
                reply = Answer(seq=message.seq, error=f"{type(exc).__name__}: {exc}")
            try:
                _send(conn, self._lock, reply)
            except OSError:
                return
