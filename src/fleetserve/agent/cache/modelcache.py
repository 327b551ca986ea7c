"""The node agent's model cache: what it holds, lookups, pins, and the one download per model.

``ModelCache`` is what the agent runtime calls: ``ensure`` (the ready path of a model, fetched
first when missing), ``get``, ``contents``, ``status``, ``pin``/``unpin`` and ``evict``. It keeps
the refs in memory under one lock and delegates the rest: ``Downloader`` fetches and verifies,
``Layout`` moves files into place atomically and sweeps after a crash, ``plan_eviction`` decides
what to evict.

Concurrent ``ensure`` calls for one model share one download (a flight): all get its progress,
and a failure is raised to each. A model is resolvable only once its ref is written, after its
verified blob is in place.

``max_bytes`` caps the bytes of blobs the refs name (a blob two refs share counts once). After each
insert the least recently used models are evicted until the cache is under its cap, never a pinned
one (a model running replicas use) nor the one just inserted; when pins keep it over the cap the
cache stays over it and says so (``over_cap``, and a log line) rather than fail the download.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from fleetserve.agent.access import SourcePolicy
from fleetserve.agent.cache import hub
from fleetserve.agent.cache.download import (
    DEFAULT_SPACE_MARGIN,
    Downloader,
    Landed,
    LandedFile,
    LandedRepo,
    disk_errors,
)
from fleetserve.agent.cache.eviction import Held, OverCap, held_bytes, over_cap, plan_eviction
from fleetserve.agent.cache.layout import Layout, engine_file_name
from fleetserve.agent.cache.progress import Meter
from fleetserve.agent.cache.refs import Entry, Ref, manifest_digest
from fleetserve.agent.cache.status import CachedModel, CacheState, ModelStatus, ProgressCallback
from fleetserve.agent.cache.transfer import Fetched
from fleetserve.errors import ModelPinned
from fleetserve.spec.resources import Model

log = logging.getLogger("fleetserve.agent.cache")


@dataclass
class _Flight:
    """One download in progress; every ensure() of the same model waits on it."""

    listeners: list[ProgressCallback] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    result: Path | None = None
    error: BaseException | None = None


class ModelCache:
    """The node's model cache under ``root``; see the module's documentation.

    ``control_plane`` is ``(base URL, token)``, the token being the node's credential (or a function
    returning the current one): it serves ``fleetserve://NAME`` sources, and the token is sent with
    any http(s) source under the same base URL, never elsewhere. ``hf://`` sources download from
    the Hub ``hub_access`` names (endpoint, token), or, when ``hf_mirror`` is set, are read from that
    local hub-cache directory, offline. ``policy`` says which local directories and remote addresses
    may be read (default: anything; the agent passes its own). Thread-safe; one instance per root.
    """

    def __init__(
        self,
        root: Path,
        max_bytes: int | None = None,
        control_plane: tuple[str, str | Callable[[], str]] | None = None,
        hf_mirror: Path | None = None,
        *,
        hub_access: hub.HubAccess | None = None,
        policy: SourcePolicy | None = None,
        attempts: int = 3,
        timeout: float = 30.0,
        space_margin: int = DEFAULT_SPACE_MARGIN,
        control_plane_verify: ssl.SSLContext | bool = True,
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must not be negative, got {max_bytes}")
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {attempts}")
        self.root = Path(root).absolute()
        self.max_bytes = max_bytes
        # Why the cache is over its cap (pins), or None when it is not.
        self.over_cap: str | None = None
        self.layout = Layout(self.root)
        self.downloader = Downloader(
            self.layout,
            control_plane=control_plane,
            control_plane_verify=control_plane_verify,
            hf_mirror=hf_mirror,
            hub_access=hub_access or hub.HubAccess(),
            policy=policy or SourcePolicy(),
            attempts=attempts,
            timeout=timeout,
            space_margin=space_margin,
        )
        self._lock = threading.RLock()
        self._pins: Counter[str] = Counter()
        self._flights: dict[str, _Flight] = {}
        self._live: dict[str, ModelStatus] = {}
        self._refs: dict[str, Ref] = self.layout.recover()
        self._clock = max((r.last_used for r in self._refs.values()), default=0.0)

    # --- queries ------------------------------------------------------------------------------

    def get(self, name: str) -> Path | None:
        """The ready file of model ``name`` (and a use, for LRU), or None when the cache lacks it."""
        with self._lock:
            ref = self._refs.get(name)
            if ref is None:
                return None
            path = self.layout.link(ref)
            if not self.layout.intact(ref):
                log.warning("model %s: its file %s vanished; forgetting it", name, path)
                self._remove_locked(ref)
                return None
            self._touch_locked(ref)
            return path

    def contents(self) -> list[CachedModel]:
        """The models ready in the cache, by name: what the agent reports for placement."""
        with self._lock:
            return [self._describe(ref) for ref in sorted(self._refs.values(), key=lambda r: r.name)]

    def total_bytes(self) -> int:
        """Bytes of the blobs the refs name, each blob once."""
        with self._lock:
            return held_bytes(self._held_locked())

    def status(self) -> list[ModelStatus]:
        """Every model's state, by name: ready ones, downloads in progress, and the last failures."""
        with self._lock:
            out = {
                r.name: ModelStatus(r.name, CacheState.READY, r.size, r.size, 0.0)
                for r in self._refs.values()
            }
            out.update(self._live)
            return [out[name] for name in sorted(out)]

    # --- pins and eviction ----------------------------------------------------------------------

    def pin(self, name: str) -> None:
        """Protect ``name`` from eviction; counted: each pin needs its own unpin (one per replica)."""
        with self._lock:
            self._pins[name] += 1

    def unpin(self, name: str) -> None:
        """Undo one pin of ``name``; unpinning what is not pinned does nothing."""
        with self._lock:
            if self._pins[name] > 1:
                self._pins[name] -= 1
            else:
                self._pins.pop(name, None)

    def pinned(self) -> list[str]:
        """The pinned model names."""
        with self._lock:
            return sorted(self._pins)

    def evict(self, name: str, *, force: bool = False) -> bool:
        """Remove model ``name`` (and forget a failed fetch of it); False when the cache lacks it.

        A pinned one needs ``force``.
        """
        with self._lock:
            live = self._live.get(name)
            if live is not None and live.state is CacheState.FAILED:
                del self._live[name]
            ref = self._refs.get(name)
            if ref is None:
                return False
            if self._pins[name] and not force:
                raise ModelPinned(
                    f"model {name!r} is pinned by {self._pins[name]} running replica(s); "
                    "unpin it (or pass force=True) to evict it"
                )
            self._remove_locked(ref)
            self._set_over_cap_locked(over_cap(self._held_locked(), self.max_bytes))
            return True

    # --- ensure ---------------------------------------------------------------------------------

    def ensure(self, model: Model, on_progress: ProgressCallback | None = None) -> Path:
        """The ready file of ``model``, fetched, verified and stored first when the cache lacks it.

        Concurrent calls for one model share one download (and all get its progress; a failure
        is raised to every caller). Blocking: call it from a worker thread, not an event loop. Raises
        SourceError (TransferInterrupted when the connection kept breaking: the part is kept),
        ChecksumMismatch or InsufficientSpace; nothing partial is ever returned.
        """
        waited = False
        while True:
            with self._lock:
                ref = self._ready_locked(model)
                if ref is not None:
                    self._touch_locked(ref)
                    if on_progress is not None and not waited:
                        on_progress(model, ref.size, ref.size, 0.0)
                    return self.layout.link(ref)
                flight = self._flights.get(model.name)
                owner = flight is None
                if flight is None:
                    flight = self._flights[model.name] = _Flight()
                    self._live.pop(model.name, None)
                if on_progress is not None and on_progress not in flight.listeners:
                    flight.listeners.append(on_progress)
            if owner:
                break
            flight.done.wait()
            if flight.error is not None:
                raise flight.error
            # Done: the loop finds it ready (or, when that download was of another definition of
            # the model, fetches this one).
            waited = True
        try:
            flight.result = self._download(model, flight)
        except BaseException as exc:
            flight.error = exc
            with self._lock:
                live = self._live.get(model.name)
                done, total = (live.done, live.total) if live else (0, model.size)
                self._live[model.name] = ModelStatus(
                    model.name, CacheState.FAILED, done, total, 0.0, str(exc), source=model.source
                )
            raise
        else:
            with self._lock:
                self._live.pop(model.name, None)
            return flight.result
        finally:
            with self._lock:
                del self._flights[model.name]
            flight.done.set()

    def _ready_locked(self, model: Model) -> Ref | None:
        ref = self._refs.get(model.name)
        if ref is None:
            return None
        if model.sha256 is not None and ref.digest != model.sha256:
            return None  # the model was redefined with other weights
        if model.sha256 is None and ref.source != model.source:
            return None  # nothing says the new source has the same bytes
        if self.layout.intact(ref):
            return ref
        link = self.layout.link(ref)
        log.warning("model %s: its file %s is missing or damaged; fetching it again", ref.name, link)
        self._remove_locked(ref)
        return None

    def _download(self, model: Model, flight: _Flight) -> Path:
        meter = Meter(model, flight.listeners, self._set_status)
        with disk_errors(model, self.root):
            landed = self.downloader.download(model, meter)
            return self._commit(model, landed)

    # --- commit ---------------------------------------------------------------------------------

    def _commit(self, model: Model, landed: Landed) -> Path:
        """Move verified parts into the store and name them; under the lock, so eviction cannot
        interleave. A repository's directory appears whole."""
        match landed:
            case LandedFile(fetched, source, resolved):
                with self._lock:
                    self._store_blob_locked(fetched)
                    ref = Ref(
                        name=model.name,
                        digest=fetched.digest,
                        size=fetched.size,
                        file_name=engine_file_name(model, source),
                        format=model.format.value,
                        source=model.source,
                        last_used=self._now(),
                        resolved=resolved,
                    )
                    return self._name_locked(ref)
            case LandedRepo(named, resolved):
                with self._lock:
                    for _, fetched in named:
                        self._store_blob_locked(fetched)
                    entries = [Entry(name, f.digest, f.size) for name, f in named]
                    ref = Ref(
                        name=model.name,
                        digest=manifest_digest(entries),
                        size=sum(e.size for e in entries),
                        file_name="",
                        format=model.format.value,
                        source=model.source,
                        last_used=self._now(),
                        files=tuple(sorted(entries, key=lambda e: e.name)),
                        resolved=resolved,
                    )
                    path = self._name_locked(ref)
                self.layout.drop_parts_dir(model.name)
                return path

    def _store_blob_locked(self, fetched: Fetched) -> None:
        self.layout.store_blob(fetched.path, fetched.digest, fetched.size)

    def _name_locked(self, ref: Ref) -> Path:
        """Link a stored model, write its ref last, drop what its previous definition alone used."""
        self.layout.name(ref)
        old = self._refs.get(ref.name)
        self._refs[ref.name] = ref
        if old is not None:
            for digest in set(old.blobs()) - set(ref.blobs()):
                self._drop_blob_if_unused(digest)
        self._evict_to_cap_locked(keep=ref.name)
        return self.layout.link(ref)

    # --- eviction -------------------------------------------------------------------------------

    def _held_locked(self) -> list[Held]:
        """What the cache holds, as the eviction decision sees it."""
        return [Held(r.name, r.blobs(), r.last_used, bool(self._pins[r.name])) for r in self._refs.values()]

    def _evict_to_cap_locked(self, keep: str) -> None:
        if self.max_bytes is None:
            return
        plan = plan_eviction(self._held_locked(), self.max_bytes, keep=keep)
        for name in plan.evict:
            log.info("model cache over its cap: evicting %s (least recently used)", name)
            self._remove_locked(self._refs[name])
        self._set_over_cap_locked(plan.over_cap)

    def _set_over_cap_locked(self, over: OverCap | None) -> None:
        self.over_cap = None if over is None else over.message(self.root)
        if self.over_cap is not None:
            log.warning("%s", self.over_cap)

    def _remove_locked(self, ref: Ref) -> None:
        self.layout.remove(ref)
        self._refs.pop(ref.name, None)
        for digest in ref.blobs():
            self._drop_blob_if_unused(digest)

    def _drop_blob_if_unused(self, digest: str) -> None:
        if all(digest not in r.blobs() for r in self._refs.values()):
            self.layout.drop_blob(digest)

    # --- bookkeeping ----------------------------------------------------------------------------

    def _set_status(self, status: ModelStatus) -> None:
        with self._lock:
            self._live[status.model] = status

    def _now(self) -> float:
        """Wall-clock time, strictly increasing across calls so that LRU order is total."""
        self._clock = max(time.time(), self._clock + 1e-6)
        return self._clock

    def _touch_locked(self, ref: Ref) -> None:
        touched = replace(ref, last_used=self._now())
        self._refs[ref.name] = touched
        try:
            self.layout.write_ref(touched)
        except OSError as exc:  # a use that cannot be recorded still serves the model
            log.warning("model %s: cannot record its use: %s", ref.name, exc)

    def _describe(self, ref: Ref) -> CachedModel:
        return CachedModel(
            name=ref.name,
            digest=ref.digest,
            size=ref.size,
            last_used=datetime.fromtimestamp(ref.last_used, UTC),
            path=self.layout.link(ref),
            file_name=ref.file_name,
            format=ref.format,
            source=ref.source,
            pinned=bool(self._pins[ref.name]),
            files=tuple(e.name for e in ref.files),
            resolved=ref.resolved,
        )
