"""The node agent's main loop: register, heartbeat and report, follow assignments, fence.

- Enrol with the join token (once; the node's credential is kept, see ``agent/client.py``) or
  register with the credential: the server answers with the node's epoch and its assignments.
  An enrolment waiting for an operator's approval is logged as an error and retried.
  Anything the agent runs that is not assigned is stopped — after a Lost node returns, its old
  replicas were placed elsewhere under new names, and they never run twice.
- Every ``interval`` seconds a status report (replica states, stderr tails, cache contents,
  downloads) doubles as the heartbeat. A 409 (the node registered again meanwhile) means
  register again, then fence.
- A long-poll follows the assignments; each new replica gets its model from the cache (pinned
  while it runs), a free port, a launch spec from its engine's adapter, and the supervisor.
- Stops (unassigned, the server's "stop", the fence) never run on those threads: each runs on its
  own (``agent/stopper.py``), all at once, so a heartbeat never waits out an engine's grace. A
  replica being stopped is left out of the report (no ``ReplicaState`` says stopping, and
  ``Draining`` is the control plane's word); its processes stay the node's own until gone, and a
  replica assigned again under that name starts only then (reported Starting meanwhile).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import zmq

from fleetserve.agent.adapters import AdapterSync
from fleetserve.agent.cache import CacheState, ModelCache
from fleetserve.agent.client import AgentApiError, AgentClient, EnrolmentPending
from fleetserve.agent.kvevents import KvEventsListener
from fleetserve.agent.stopper import Stopper
from fleetserve.agent.supervisor import Supervisor
from fleetserve.drivers import RuntimeVariant
from fleetserve.engines.binaries import resolve
from fleetserve.engines.launch import LaunchContext
from fleetserve.engines.registry import ENGINES, formats_text, weights_for
from fleetserve.engines.spec import EngineKind
from fleetserve.errors import FleetserveError, InternalError, SourceError, StaleEpoch
from fleetserve.metrics.engine import in_flight
from fleetserve.metrics.mapping import MetricMapping
from fleetserve.metrics.promtext import ExpositionError
from fleetserve.protocol import (
    Assignment,
    AssignmentSet,
    Download,
    GpuSample,
    KvCacheSummary,
    ReplicaReport,
    StatusReport,
)
from fleetserve.routing import engine_auth
from fleetserve.spec.nodeparts import EngineFingerprint
from fleetserve.spec.resources import DeviceClass, Model, Node, Replica, ReplicaState
from fleetserve.units import format_bytes

log = logging.getLogger("fleetserve.agent")

# Describes this machine as a Node: (classes, pids fleetserve started, cached models) → node, problems.
Describe = Callable[[list[DeviceClass], frozenset[int], tuple[str, ...]], tuple[Node, list[str]]]
# This node's engine fingerprints (``agent/fingerprint.py``), asked at registration and every
# ``ENGINE_CHECK_REPORTS`` reports; a change registers the node again with the new facts.
Fingerprints = Callable[[], tuple[EngineFingerprint, ...]]
ENGINE_CHECK_REPORTS = 6


def free_port(host: str) -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class AgentSettings:
    """How the agent runs engines."""

    engine_host: str = "127.0.0.1"
    interval: float = 5.0
    binaries: Mapping[tuple[EngineKind, RuntimeVariant], str] = field(default_factory=dict)


class Agent:
    """One node's agent."""

    def __init__(
        self,
        client: AgentClient,
        describe: Describe,
        supervisor: Supervisor,
        cache: ModelCache,
        settings: AgentSettings,
        gpu_reader: Callable[[Node], list[GpuSample]] | None = None,
        engines: Fingerprints | None = None,
    ) -> None:
        self.gpu_reader = gpu_reader
        # None: the node reports no engines (placement then does not filter it on engines).
        self.engines = engines
        self._reports = 0
        self.client = client
        self.describe = describe
        self.supervisor = supervisor
        self.cache = cache
        self.settings = settings
        self.node: Node | None = None
        self.epoch = 0
        self.revision: str | None = None
        self.problems: list[str] = []
        self._lock = threading.RLock()
        self._wanted: dict[str, Assignment] = {}  # replica → its assignment
        self._preparing: set[str] = set()
        self._model_of: dict[str, str] = {}  # replica → the model it serves (one pin each)
        self._draft_of: dict[str, str] = {}  # replica → its speculative draft model (one pin each)
        # replica → its engine's metrics URL and metric names: the in-flight count a drain waits on
        self._metrics_of: dict[str, tuple[str, MetricMapping, str | None]] = {}
        # replica → its last in-flight reading and when (monotonic) it was taken
        self._in_flight_seen: dict[str, tuple[int, float]] = {}
        # A busy engine answers /metrics late: readings are taken off the report (heartbeat) path.
        self._http = httpx.Client(timeout=10.0)
        self._progress: dict[str, tuple[int, float]] = {}  # model → (bytes done, when that changed)
        self.stopper = Stopper(self._stop_now, self._stopped)
        self._stop_asked_at: dict[str, str | None] = {}  # replica stopping → the revision then
        self._closing = False  # shutting down: nothing new starts
        # Each replica's LoRA adapters: loaded at start, and where its engine can, at run time.
        self.adapters = AdapterSync(self._fetch_adapter, cache.unpin, settings.engine_host)
        # replica → its engine's KV events socket, on loopback (``agent/kvevents.py``)
        self._kv_events: dict[str, KvEventsListener] = {}

    def _fetch_adapter(self, adapter: Model) -> Path:
        """An adapter's files in the node's cache, fetched and checked like a model's, pinned."""
        path = self.cache.ensure(adapter)
        self.cache.pin(adapter.name)
        return path

    # --- registration and fencing ----------------------------------------------------------------

    def register(self) -> None:
        """Register (again) and fence: stop every replica not assigned to this node now."""
        classes = self.client.classes()
        cached = tuple(m.name for m in self.cache.contents())
        node, problems = self.describe(classes, self.supervisor.own_pids(), cached)
        if self.engines is not None:
            node = node.model_copy(update={"engines": self.engines()})
        registered, assignments = self.client.register(node)
        with self._lock:
            self.node, self.epoch, self.problems = registered, assignments.epoch, problems
        for problem in problems:
            log.warning("discovery: %s", problem)
        log.info("registered node %s at epoch %d with %d devices", node.name, self.epoch, len(node.devices))
        self.follow(assignments)

    def follow(self, assignments: AssignmentSet) -> None:
        """Make what runs match the assignments: stop the unassigned, start the new."""
        wanted = {a.replica.name: served(a) for a in assignments.assignments}
        with self._lock:
            self.revision = assignments.revision
            self._wanted = wanted
        # A replica kept (its deployment is gone; it drains) runs on until it is released.
        for name in self.supervisor.names() - set(wanted) - set(assignments.keep):
            self._stop(name, "no longer assigned to this node")
        self._start_wanted()

    def _start_wanted(self) -> None:
        """Start preparing every assigned replica that neither runs, prepares nor is stopping."""
        with self._lock:
            if self._closing:
                return
            busy = self.supervisor.names() | self._preparing | self.stopper.stopping()
            entries = [entry for name, entry in self._wanted.items() if name not in busy]
            self._preparing.update(entry.replica.name for entry in entries)
        for entry in entries:
            threading.Thread(
                target=self._prepare, args=(entry,), name=f"prepare-{entry.replica.name}", daemon=True
            ).start()

    # --- starting a replica ----------------------------------------------------------------------

    def _prepare(self, entry: Assignment) -> None:
        replica = entry.replica
        try:
            self._start(replica, entry)
        except FleetserveError as exc:
            log.error("replica %s cannot start: %s", replica.name, exc)
            self.supervisor.fail(replica.name, str(exc))
        except Exception as exc:  # a bug here must show on the replica, not kill the agent
            log.exception("replica %s cannot start", replica.name)
            self.supervisor.fail(replica.name, f"agent error: {exc}")
        finally:
            with self._lock:
                self._preparing.discard(replica.name)

    def _registered(self) -> Node:
        """The node as registered: the agent registers before it starts or reports anything."""
        if self.node is None:
            raise InternalError("the agent has not registered its node yet")
        return self.node

    def _start(self, replica: Replica, entry: Assignment) -> None:
        node = self._registered()
        model, profile, variant, driver = entry.model, entry.profile, entry.runtime, entry.driver
        if weights_for(model, profile.engine) is None:
            raise SourceError(
                f"model {model.name} has {' and '.join(w.format.value for w in model.weights())} "
                f"weights, and {profile.engine.value} loads {formats_text(profile.engine)}: "
                f"add an alternate of format {formats_text(profile.engine)} to the model"
            )
        binary = resolve(profile.engine, variant, self.settings.binaries)
        path = self.cache.ensure(model)
        check_model_path(profile.engine, model.source, path)
        self.cache.pin(model.name)
        with self._lock:
            self._model_of[replica.name] = model.name
        draft_path = None
        if entry.draft is not None:
            # The draft is fetched, checked and pinned like the model it drafts for.
            draft_path = self.cache.ensure(entry.draft)
            check_model_path(profile.engine, entry.draft.source, draft_path)
            self.cache.pin(entry.draft.name)
            with self._lock:
                self._draft_of[replica.name] = entry.draft.name
        adapters: list[tuple[str, Path]] = []
        try:
            for adapter in entry.adapters:  # fetched, checked and pinned like the model
                adapters.append((adapter.name, self._fetch_adapter(adapter)))
        except FleetserveError:
            for name, _ in adapters:
                self.cache.unpin(name)
            raise
        self.adapters.started(replica.name, [name for name, _ in adapters])
        shard_index = next(i for i, s in enumerate(replica.shards) if s.node == node.name)
        events = self._listen_kv_events(replica.name, profile.engine) if shard_index == 0 else None
        ctx = LaunchContext(
            replica=replica,
            shard_index=shard_index,
            profile=profile,
            variant=variant,
            driver=driver,
            model_path=path,
            binary=binary,
            host=self.settings.engine_host,
            port=free_port(self.settings.engine_host),
            context=entry.context,
            peer_addresses=tuple(entry.peers),
            engine_key=entry.engine_key,
            task=entry.task,
            draft_path=draft_path,
            adapters=tuple(adapters),
            kv_events_endpoint=events.endpoint if events is not None else None,
        )
        with self._lock:
            if replica.name not in self._wanted:
                self._close_kv_events(replica.name)
                return  # unassigned while the model was fetched
        spec = ENGINES[profile.engine].adapter.launch(ctx)
        if spec.metrics_url is not None:
            with self._lock:
                engine = ENGINES[profile.engine]
                self._metrics_of[replica.name] = (spec.metrics_url, engine.metrics, entry.engine_key)
        self.supervisor.start(replica.name, spec)

    def _listen_kv_events(self, replica: str, engine: EngineKind) -> KvEventsListener | None:
        """A loopback socket for the KV events of ``replica``'s engine, where its row publishes
        them; None where it does not, or no socket could be bound (the gateways then learn only
        from what they routed)."""
        publishes = ENGINES[engine].kv_events
        if publishes is None:
            return None
        self._close_kv_events(replica)  # a start again under the same name: a fresh socket
        try:
            listener = KvEventsListener(replica, publishes.topic)
        except zmq.ZMQError as exc:  # no loopback port to bind: it serves, its events unread
            log.warning("replica %s: its KV events are not read: %s", replica, exc)
            return None
        with self._lock:
            self._kv_events[replica] = listener
        return listener

    def _close_kv_events(self, replica: str) -> None:
        with self._lock:
            listener = self._kv_events.pop(replica, None)
        if listener is not None:
            listener.close()

    def _kv_summary(self, replica: str, restarts: int) -> KvCacheSummary | None:
        with self._lock:
            listener = self._kv_events.get(replica)
        return None if listener is None else listener.summary(restarts)

    def _in_flight(self, name: str) -> int | None:
        """The requests a replica's engine is running or holding now, from its own metrics; None
        when they cannot be read."""
        with self._lock:
            target = self._metrics_of.get(name)
        if target is None:
            return None
        url, mapping, key = target
        try:
            # The engine's own key: its metrics are as closed as its API.
            response = self._http.get(url, headers=engine_auth(key))
            response.raise_for_status()
            return in_flight(response.text, mapping)
        except (httpx.HTTPError, ExpositionError):
            return None

    def sample_in_flight(self) -> None:
        """Read every Running replica's in-flight count once (what a drain waits on)."""
        running = {n for n, s in self.supervisor.status().items() if s.state is ReplicaState.RUNNING}
        for name in running:
            read_at = time.monotonic()
            value = self._in_flight(name)
            with self._lock:
                if value is None:
                    self._in_flight_seen.pop(name, None)
                else:
                    self._in_flight_seen[name] = (value, read_at)
        with self._lock:
            for name in set(self._in_flight_seen) - running:
                del self._in_flight_seen[name]

    def _in_flight_report(self, name: str) -> dict[str, Any]:
        """The last in-flight reading of a replica and its age, as report fields (none if unread)."""
        with self._lock:
            seen = self._in_flight_seen.get(name)
        if seen is None:
            return {}
        value, read_at = seen
        return {"inFlight": value, "inFlightAge": round(max(0.0, time.monotonic() - read_at), 3)}

    # --- reporting --------------------------------------------------------------------------------

    def report(self) -> None:
        """One status report (also the heartbeat); re-register on a stale epoch."""
        node = self._registered()
        stopping = self.stopper.stopping()
        statuses = {n: s for n, s in self.supervisor.status().items() if n not in stopping}
        replicas = {
            name: ReplicaReport(
                state=s.state,
                message=s.message[:4000],
                restarts=s.restarts,
                stderrTail=[line[:2000] for line in s.stderr_tail],
                port=s.port or None,
                adapters=self.adapters.loaded(name),
                kvCache=self._kv_summary(name, s.restarts),
                **self._in_flight_report(name),
            )
            for name, s in statuses.items()
        }
        self._sync_adapters(statuses)
        cache_status = self.cache.status()
        with self._lock:
            preparing, wanted = set(self._preparing), set(self._wanted)
        for name in preparing - set(statuses):
            replicas[name] = ReplicaReport(state=ReplicaState.STARTING, message=self._fetching(name))
        for name in (wanted & (stopping | self.supervisor.stopping())) - set(replicas):
            replicas[name] = ReplicaReport(
                state=ReplicaState.STARTING, message="waiting for the previous engine under this name to stop"
            )
        downloads = [
            Download(
                model=s.model,
                state=s.state.value,
                done=s.done,
                total=s.total,
                rate=s.rate,
                source=s.source[:2000],
                error=s.error[:4000] if s.error else None,
            )
            for s in cache_status
        ]
        report = StatusReport(
            node=node.name,
            epoch=self.epoch,
            replicas=replicas,
            modelCache=[m.name for m in self.cache.contents()],
            downloads=downloads,
            problems=[p[:2000] for p in self.problems[:100]],
        )
        if self.gpu_reader is not None:
            try:
                report.gpu_metrics = self.gpu_reader(node)
            except (OSError, ValueError) as exc:
                log.warning("reading the GPUs failed: %s", exc)
        try:
            stop = self.client.status(report)
        except StaleEpoch:
            log.warning("the node registered again elsewhere or was fenced; registering again")
            self.register()
            return
        for name in stop:
            self._stop(name, "the server says it is not this node's")

    def _sync_adapters(self, statuses: Mapping[str, Any]) -> None:
        """Have each Running replica load and unload the adapters its assignment added or dropped,
        where its engine can while it runs (``agent/adapters.py``); off this thread."""
        with self._lock:
            wanted = dict(self._wanted)
        for name, status in statuses.items():
            entry = wanted.get(name)
            if entry is None or status.state is not ReplicaState.RUNNING:
                continue
            self.adapters.sync(
                name, entry.profile.engine, entry.adapters, status.port, status.restarts, entry.engine_key
            )

    def _fetching(self, replica: str) -> str:
        """What a replica waiting for its model says: the download's source, progress, or stall."""
        with self._lock:
            entry = self._wanted.get(replica)
        if entry is None:
            return "fetching the model"
        model = entry.model
        status = next((s for s in self.cache.status() if s.model == model.name), None)
        if status is None or status.state is not CacheState.DOWNLOADING:
            return f"fetching model {model.name} from {model.source}"
        now = time.monotonic()
        last = self._progress.get(model.name)
        if last is None or last[0] != status.done:
            self._progress[model.name] = last = (status.done, now)
        return download_message(
            model.name, model.source, status.done, status.total, status.rate, now - last[1]
        )

    def _stop(self, name: str, why: str) -> None:
        """Have a replica stopped on a thread of its own (``agent/stopper.py``); returns at once."""
        with self._lock:
            if not self.stopper.stop(name):
                return
            self._stop_asked_at[name] = self.revision
        log.info("stopping %s: %s", name, why)

    def _stop_now(self, name: str) -> None:
        """Stop a replica (its grace waited out here) and then drop its pin on its model (pins are
        counted per replica): on a stopper thread."""
        self.supervisor.stop(name)
        with self._lock:
            model = self._model_of.pop(name, None)
            draft = self._draft_of.pop(name, None)
            self._metrics_of.pop(name, None)
        self._close_kv_events(name)
        if model is not None:
            self.cache.unpin(model)
        if draft is not None:
            self.cache.unpin(draft)
        for adapter in self.adapters.stopped(name):
            self.cache.unpin(adapter)

    def _stopped(self, name: str) -> None:
        """A stop is done: a replica assigned again under that name (by assignments newer than the
        stop) starts now. One the server said to stop while the assignments this agent holds still
        list it waits for the next ones: the server's word is the newer."""
        with self._lock:
            asked_at = self._stop_asked_at.pop(name, None)
            again = name in self._wanted and self.revision != asked_at
        if again:
            self._start_wanted()

    # --- loops ------------------------------------------------------------------------------------

    def engines_changed(self) -> bool:
        """Whether this node's engine fingerprints differ from those it registered with."""
        if self.engines is None:
            return False
        return self.engines() != self._registered().engines

    def _report_loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.settings.interval):
            try:
                self.report()
                self._reports += 1
                if self._reports % ENGINE_CHECK_REPORTS == 0 and self.engines_changed():
                    log.warning("engines: the engine binaries changed; registering again")
                    self.register()
            except FleetserveError as exc:
                log.warning("status report failed: %s", exc)

    def _sample_loop(self, stop: threading.Event) -> None:
        while not stop.wait(max(0.25, self.settings.interval / 2)):
            self.sample_in_flight()

    def _watch_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                with self._lock:
                    epoch, since = self.epoch, self.revision
                assignments = self.client.assignments(self._registered().name, epoch, since, wait=20.0)
                if assignments.revision != since:
                    self.follow(assignments)
            except StaleEpoch:
                try:
                    self.register()
                except FleetserveError as exc:
                    log.warning("registration failed: %s", exc)
                    stop.wait(self.settings.interval)
            except AgentApiError as exc:
                log.warning("assignments: %s", exc)
                stop.wait(self.settings.interval)

    def run(self, stop: threading.Event) -> None:
        """Register (retrying until the server answers), then follow and report until ``stop``."""
        while not stop.is_set():
            try:
                self.register()
                break
            except EnrolmentPending as exc:
                log.error("enrolment refused: %s (retrying every %.0f s)", exc, self.settings.interval)
                stop.wait(self.settings.interval)
            except AgentApiError as exc:
                log.warning("registration failed, retrying: %s", exc)
                stop.wait(self.settings.interval)
        threads = [
            threading.Thread(target=self._report_loop, args=(stop,), name="report", daemon=True),
            threading.Thread(target=self._watch_loop, args=(stop,), name="watch", daemon=True),
            threading.Thread(target=self._sample_loop, args=(stop,), name="in-flight", daemon=True),
        ]
        for thread in threads:
            thread.start()
        stop.wait()
        with self._lock:
            self._closing = True
        self.stopper.wait()  # no process left behind: every stop in flight ends first
        self.supervisor.shutdown()
        for name in list(self._kv_events):
            self._close_kv_events(name)


def served(entry: Assignment) -> Assignment:
    """The assignment with the weights its engine serves (``weights_for``): what the server sends
    already; a model document with alternates (from a server that did not choose) is reduced here."""
    weights = weights_for(entry.model, entry.profile.engine)
    return entry if weights is None or weights == entry.model else entry.model_copy(update={"model": weights})


def check_model_path(engine: EngineKind, source: str, path: Path) -> None:
    """Refuse a whole repository (a directory) for an engine that loads one file."""
    if path.is_dir() and not ENGINES[engine].serves_directory:
        raise SourceError(
            f"{source} is a whole repository, and {engine.value} loads one model file: name the file, "
            "e.g. hf://ORG/REPO/FILE.gguf"
        )


# Seconds without a byte after which a download is reported stalled.
STALL_SECONDS = 60.0


def download_message(model: str, source: str, done: int, total: int | None, rate: float, idle: float) -> str:
    """A replica's message while its model downloads: source, bytes, rate; or that it stalled."""
    of = f" of {format_bytes(total)}" if total is not None else ""
    if idle >= STALL_SECONDS:
        return (
            f"download of model {model} from {source} stalled: no bytes for {idle:.0f} s at "
            f"{format_bytes(done)}{of} (the transfer resumes where it stopped)"
        )
    return f"downloading model {model} from {source}: {format_bytes(done)}{of} at {format_bytes(int(rate))}/s"


def default_cache_dir() -> Path:
    """The model cache's default location."""
    return Path.home() / ".cache" / "fleetserve" / "models"
