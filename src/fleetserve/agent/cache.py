"""The node agent's model cache: content-addressed, verified, resumable, bounded.

Layout under the cache's root directory::

    blobs/sha256/<hex>          the weights, named by their sha256, read-only, verified on the way in
    refs/<model>.json           model name → digest, file name, format, size, source, last use
    models/<model>/<file>       a relative symlink to the blob: the path engines are given, with the
                                source's file name (vLLM recognises GGUF by the ``.gguf`` suffix)
    partial/<model>.part        a transfer in progress; ``partial/<model>.json`` makes it resumable

Everything lands by rename from a temporary file in the same filesystem after an fsync, and the ref
is written last: a model is resolvable only once its verified blob is in place, and a ``.part`` is
never returned. On start, whatever a crash left half done is swept: temporary files, refs whose blob
is gone, blobs no ref names, parts without a sidecar (copies, which cannot resume). A part with a
sidecar stays for the next ``ensure`` to resume.

``max_bytes`` caps the bytes of blobs the refs name (a blob two refs share counts once). After each
insert the least recently used models are evicted until the cache is under its cap, never a pinned
one (a model running replicas use) nor the one just inserted; when pins keep it over the cap the
cache stays over it and says so (``over_cap``, and a log line) rather than fail the download.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import ssl
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetserve.agent.fetch import (
    Fetched,
    atomic_write,
    control_plane_url,
    copy_file,
    discard_partial,
    fetch,
    fsync_dir,
    hf_mirror_file,
    sidecar_path,
)
from fleetserve.errors import (
    CacheError,
    ChecksumMismatch,
    InsufficientSpace,
    ModelPinned,
    SourceError,
    TransferInterrupted,
)
from fleetserve.sources import (
    ControlPlaneSource,
    HfSource,
    HttpSource,
    LocalSource,
    Source,
    parse_source,
    source_file_name,
)
from fleetserve.spec.resources import Model, ModelFormat
from fleetserve.units import format_bytes

if TYPE_CHECKING:
    from rich.console import Console

log = logging.getLogger("fleetserve.agent.cache")

# (model, done bytes, total bytes or None, bytes per second), at most ~10 times a second.
ProgressCallback = Callable[[Model, int, int | None, float], None]

# Free disk a download leaves untouched, beyond its own size.
DEFAULT_SPACE_MARGIN = 64 * 2**20
# Seconds between two progress reports of one transfer (the last one is always reported).
PROGRESS_INTERVAL = 0.1
_HEX64 = re.compile(r"[0-9a-f]{64}")
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,199}")
_EXTENSIONS = {ModelFormat.GGUF: "gguf", ModelFormat.SAFETENSORS: "safetensors"}


class CacheState(StrEnum):
    """Where a model stands in the cache, as the agent reports it."""

    DOWNLOADING = "downloading"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class CachedModel:
    """A model the cache holds, ready to serve."""

    name: str
    digest: str
    size: int
    last_used: datetime
    path: Path
    file_name: str
    format: str
    source: str
    pinned: bool


@dataclass(frozen=True)
class ModelStatus:
    """One model's cache state for the node's status: bytes done, total (None = unknown), rate."""

    model: str
    state: CacheState
    done: int
    total: int | None
    rate: float
    error: str | None = None


@dataclass(frozen=True)
class _Ref:
    name: str
    digest: str
    size: int
    file_name: str
    format: str
    source: str
    last_used: float

    def dump(self) -> bytes:
        doc = {
            "name": self.name,
            "digest": f"sha256:{self.digest}",
            "size": self.size,
            "file": self.file_name,
            "format": self.format,
            "source": self.source,
            "lastUsed": self.last_used,
        }
        return json.dumps(doc, sort_keys=True, indent=1).encode()

    @classmethod
    def load(cls, path: Path) -> _Ref | None:
        try:
            doc: Any = json.loads(path.read_bytes())
            algorithm, _, digest = str(doc["digest"]).partition(":")
            ref = cls(
                name=str(doc["name"]),
                digest=digest,
                size=int(doc["size"]),
                file_name=str(doc["file"]),
                format=str(doc["format"]),
                source=str(doc["source"]),
                last_used=float(doc["lastUsed"]),
            )
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None
        if algorithm != "sha256" or not _HEX64.fullmatch(digest) or not _FILE_NAME.fullmatch(ref.file_name):
            return None
        return ref if path.stem == ref.name else None


@dataclass
class _Flight:
    """One download in progress; every ensure() of the same model waits on it."""

    listeners: list[ProgressCallback] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    result: Path | None = None
    error: BaseException | None = None


class _Meter:
    """Turns per-chunk byte counts into throttled progress reports and the model's live status."""

    def __init__(self, cache: ModelCache, model: Model, flight: _Flight) -> None:
        self._cache = cache
        self._model = model
        self._flight = flight
        self._start = time.monotonic()
        self._start_bytes: int | None = None
        self._last_report = float("-inf")
        self._last: tuple[int, int | None] = (0, None)
        self._reported: tuple[int, int | None] | None = None

    def __call__(self, done: int, total: int | None) -> None:
        now = time.monotonic()
        if self._start_bytes is None or done < self._last[0]:
            # A new transfer (or a restart from zero): the rate counts this transfer's bytes only.
            self._start, self._start_bytes = now, done
        self._last = (done, total)
        elapsed = now - self._start
        rate = (done - self._start_bytes) / elapsed if elapsed > 0 else 0.0
        self._cache._set_status(ModelStatus(self._model.name, CacheState.DOWNLOADING, done, total, rate))
        if now - self._last_report >= PROGRESS_INTERVAL:
            self._last_report = now
            self._report(done, total, rate)

    def finish(self, size: int) -> None:
        """Report the final count, which the throttle may have held back."""
        if self._reported != (size, size):
            elapsed = time.monotonic() - self._start
            rate = (size - (self._start_bytes or 0)) / elapsed if elapsed > 0 else 0.0
            self._report(size, size, rate)

    def _report(self, done: int, total: int | None, rate: float) -> None:
        self._reported = (done, total)
        for listener in list(self._flight.listeners):
            try:
                listener(self._model, done, total, rate)
            except Exception:
                log.exception("a progress callback for model %s failed", self._model.name)


class ModelCache:
    """The node's model cache under ``root``; see the module's documentation.

    ``control_plane`` is ``(base URL, token)``, the token being the node's credential (or a function
    returning the current one): it serves ``fleetserve://NAME`` sources, and the token is sent with
    any http(s) source under the same base URL, never elsewhere. ``hf_mirror`` is the local
    hub-cache directory ``hf://`` sources are read from, offline. Thread-safe; one instance per root.
    """

    def __init__(
        self,
        root: Path,
        max_bytes: int | None = None,
        control_plane: tuple[str, str | Callable[[], str]] | None = None,
        hf_mirror: Path | None = None,
        *,
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
        self.control_plane = control_plane
        # How URLs on the control plane are verified (its pinned CA); others use the system's CAs.
        self.control_plane_verify = control_plane_verify
        self.hf_mirror = hf_mirror
        self.attempts = attempts
        self.timeout = timeout
        self.space_margin = space_margin
        # Why the cache is over its cap (pins), or None when it is not.
        self.over_cap: str | None = None
        self._blobs = self.root / "blobs" / "sha256"
        self._refs_dir = self.root / "refs"
        self._models = self.root / "models"
        self._partial = self.root / "partial"
        self._lock = threading.RLock()
        self._refs: dict[str, _Ref] = {}
        self._pins: Counter[str] = Counter()
        self._flights: dict[str, _Flight] = {}
        self._live: dict[str, ModelStatus] = {}
        self._clock = 0.0
        self._recover()

    # --- queries ------------------------------------------------------------------------------

    def get(self, name: str) -> Path | None:
        """The ready file of model ``name`` (and a use, for LRU), or None when the cache lacks it."""
        with self._lock:
            ref = self._refs.get(name)
            if ref is None:
                return None
            path = self._link(ref)
            if not path.is_file():
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
            return self._total_locked()

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
            self._update_over_cap_locked()
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
                    return self._link(ref)
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
                    model.name, CacheState.FAILED, done, total, 0.0, str(exc)
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

    def _ready_locked(self, model: Model) -> _Ref | None:
        ref = self._refs.get(model.name)
        if ref is None:
            return None
        if model.sha256 is not None and ref.digest != model.sha256:
            return None  # the model was redefined with other weights
        if model.sha256 is None and ref.source != model.source:
            return None  # nothing says the new source has the same bytes
        link = self._link(ref)
        try:
            if link.stat().st_size == ref.size:
                return ref
        except OSError:
            pass
        log.warning("model %s: its file %s is missing or damaged; fetching it again", ref.name, link)
        self._remove_locked(ref)
        return None

    def _download(self, model: Model, flight: _Flight) -> Path:
        try:
            return self._download_unguarded(model, flight)
        except OSError as exc:  # the cache's own disk: the sources' errors are SourceErrors already
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise InsufficientSpace(
                    f"model {model.name!r} from {model.source}: the disk under the cache directory "
                    f"{self.root} filled up during the download ({exc.strerror}); the partial file is "
                    "kept and resumes once space is freed",
                    needed=model.size or 0,
                    free=shutil.disk_usage(self.root).free,
                    cache_dir=str(self.root),
                ) from exc
            raise CacheError(
                f"model {model.name!r}: cannot write to the cache directory {self.root}: {exc}"
            ) from exc

    def _download_unguarded(self, model: Model, flight: _Flight) -> Path:
        shown = model.source or "(no source)"
        try:
            source = parse_source(model.source)
        except SourceError as exc:
            raise SourceError(f"model {model.name!r}: {exc}") from None
        part = self._partial / f"{model.name}.part"
        meter = _Meter(self, model, flight)
        self._set_status(ModelStatus(model.name, CacheState.DOWNLOADING, 0, model.size, 0.0))
        for attempt in range(1, self.attempts + 1):
            try:
                fetched = self._transfer(model, source, part, meter)
                break
            except TransferInterrupted as exc:
                if attempt == self.attempts:
                    raise TransferInterrupted(
                        f"model {model.name!r} from {shown}: {exc} (gave up after {attempt} attempt(s))"
                    ) from exc
                log.warning(
                    "model %s: %s; attempt %d of %d resumes", model.name, exc, attempt + 1, self.attempts
                )
            except SourceError as exc:
                raise SourceError(f"model {model.name!r} from {shown}: {exc}") from exc
        if model.sha256 is not None and fetched.digest != model.sha256:
            discard_partial(part)
            raise ChecksumMismatch(model.name, shown, model.sha256, fetched.digest)
        meter.finish(fetched.size)
        return self._commit(model, source, fetched)

    def _transfer(self, model: Model, source: Source, part: Path, meter: _Meter) -> Fetched:
        def check_space(needed: int) -> None:
            self._check_space(model, needed)

        if model.size is not None:
            have = part.stat().st_size if sidecar_path(part).is_file() and part.is_file() else 0
            check_space(max(0, model.size - have))
        match source:
            case LocalSource(path):
                return copy_file(path, part, on_bytes=meter, check_space=check_space)
            case HfSource():
                if self.hf_mirror is None:
                    raise SourceError("hf:// sources need a Hugging Face mirror directory (hf_mirror)")
                found = hf_mirror_file(self.hf_mirror, source)
                return copy_file(found, part, on_bytes=meter, check_space=check_space)
            case HttpSource(url):
                return fetch(
                    url,
                    part,
                    headers=self._auth_for(url),
                    on_bytes=meter,
                    check_space=check_space,
                    timeout=self.timeout,
                    verify=self._verify_for(url),
                )
            case ControlPlaneSource(name):
                if self.control_plane is None:
                    raise SourceError("fleetserve:// sources need the control plane's URL and a credential")
                url = control_plane_url(self.control_plane[0], name)
                try:
                    return fetch(
                        url,
                        part,
                        headers=self._auth_for(url),
                        on_bytes=meter,
                        check_space=check_space,
                        timeout=self.timeout,
                        verify=self._verify_for(url),
                    )
                except TransferInterrupted:
                    raise
                except SourceError as exc:
                    if "refused the bearer token" in str(exc):
                        raise SourceError(f"{exc}: the control plane refused the node's credential") from exc
                    raise
        raise AssertionError(f"unhandled source {source!r}")  # pragma: no cover

    def _auth_for(self, url: str) -> dict[str, str]:
        """The node's credential, for URLs on the control plane only: never sent anywhere else."""
        if self.control_plane is None:
            return {}
        base, token = self.control_plane
        if url.startswith(base.rstrip("/") + "/"):
            return {"Authorization": f"Bearer {token if isinstance(token, str) else token()}"}
        return {}

    def _verify_for(self, url: str) -> ssl.SSLContext | bool:
        """The control plane's verification for URLs on it; the system's CAs for any other."""
        if self.control_plane is not None and url.startswith(self.control_plane[0].rstrip("/") + "/"):
            return self.control_plane_verify
        return True

    def _check_space(self, model: Model, needed: int) -> None:
        free = shutil.disk_usage(self.root).free
        if needed + self.space_margin > free:
            raise InsufficientSpace(
                f"model {model.name!r} from {model.source}: not enough free disk in the cache directory "
                f"{self.root}: the download needs {format_bytes(needed)} ({needed} bytes) plus a "
                f"{format_bytes(self.space_margin)} margin, but only {format_bytes(free)} ({free} bytes) "
                "is free; nothing was written",
                needed=needed,
                free=free,
                cache_dir=str(self.root),
            )

    def _commit(self, model: Model, source: Source, fetched: Fetched) -> Path:
        """Move a verified part into the store and name it; under the lock, so eviction cannot interleave."""
        with self._lock:
            blob = self._blobs / fetched.digest
            if blob.is_file() and blob.stat().st_size == fetched.size:
                fetched.path.unlink()
            else:
                os.chmod(fetched.path, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
                os.replace(fetched.path, blob)
                fsync_dir(self._blobs)
            sidecar_path(fetched.path).unlink(missing_ok=True)
            ref = _Ref(
                name=model.name,
                digest=fetched.digest,
                size=fetched.size,
                file_name=_file_name(model, source),
                format=model.format.value,
                source=model.source,
                last_used=self._now(),
            )
            self._place_link(ref)
            atomic_write(self._refs_dir / f"{ref.name}.json", ref.dump())
            old = self._refs.get(ref.name)
            self._refs[ref.name] = ref
            if old is not None and old.digest != ref.digest:
                self._drop_blob_if_unused(old.digest)
            self._evict_to_cap_locked(keep=ref.name)
            return self._link(ref)

    # --- eviction -------------------------------------------------------------------------------

    def _evict_to_cap_locked(self, keep: str) -> None:
        if self.max_bytes is None:
            return
        while self._total_locked() > self.max_bytes:
            protected = {r.digest for r in self._refs.values() if r.name == keep or self._pins[r.name]}
            # A model whose blob a protected model shares frees nothing: evicting it only loses it.
            candidates = [
                r
                for r in self._refs.values()
                if r.name != keep and not self._pins[r.name] and r.digest not in protected
            ]
            if not candidates:
                break
            victim = min(candidates, key=lambda r: r.last_used)
            log.info("model cache over its cap: evicting %s (least recently used)", victim.name)
            self._remove_locked(victim)
        self._update_over_cap_locked(keep)

    def _update_over_cap_locked(self, keep: str | None = None) -> None:
        total = self._total_locked()
        if self.max_bytes is None or total <= self.max_bytes:
            self.over_cap = None
            return
        pinned = sorted(n for n in self._refs if self._pins[n])
        reasons = []
        if pinned:
            reasons.append(f"pinned by running replicas: {', '.join(pinned)}")
        if keep is not None and keep in self._refs and keep not in pinned:
            reasons.append(f"just fetched: {keep}")
        self.over_cap = (
            f"model cache {self.root} holds {format_bytes(total)} ({total} bytes), over its cap of "
            f"{format_bytes(self.max_bytes)} ({self.max_bytes} bytes); what is left cannot be evicted "
            f"({'; '.join(reasons) or 'shared blobs'})"
        )
        log.warning("%s", self.over_cap)

    def _remove_locked(self, ref: _Ref) -> None:
        (self._refs_dir / f"{ref.name}.json").unlink(missing_ok=True)
        fsync_dir(self._refs_dir)
        self._refs.pop(ref.name, None)
        shutil.rmtree(self._models / ref.name, ignore_errors=True)
        self._drop_blob_if_unused(ref.digest)

    def _drop_blob_if_unused(self, digest: str) -> None:
        if all(r.digest != digest for r in self._refs.values()):
            (self._blobs / digest).unlink(missing_ok=True)

    def _total_locked(self) -> int:
        return sum({r.digest: r.size for r in self._refs.values()}.values())

    # --- bookkeeping ----------------------------------------------------------------------------

    def _set_status(self, status: ModelStatus) -> None:
        with self._lock:
            self._live[status.model] = status

    def _now(self) -> float:
        """Wall-clock time, strictly increasing across calls so that LRU order is total."""
        self._clock = max(time.time(), self._clock + 1e-6)
        return self._clock

    def _touch_locked(self, ref: _Ref) -> None:
        touched = replace(ref, last_used=self._now())
        self._refs[ref.name] = touched
        try:
            atomic_write(self._refs_dir / f"{ref.name}.json", touched.dump())
        except OSError as exc:  # a use that cannot be recorded still serves the model
            log.warning("model %s: cannot record its use: %s", ref.name, exc)

    def _link(self, ref: _Ref) -> Path:
        return self._models / ref.name / ref.file_name

    def _place_link(self, ref: _Ref) -> None:
        folder = self._models / ref.name
        folder.mkdir(parents=True, exist_ok=True)
        link = folder / ref.file_name
        tmp = folder / f".{ref.file_name}.tmp"
        tmp.unlink(missing_ok=True)
        os.symlink(Path("..", "..", "blobs", "sha256", ref.digest), tmp)
        os.replace(tmp, link)
        for other in folder.iterdir():
            if other.name != ref.file_name:
                other.unlink(missing_ok=True)
        fsync_dir(folder)

    def _describe(self, ref: _Ref) -> CachedModel:
        return CachedModel(
            name=ref.name,
            digest=ref.digest,
            size=ref.size,
            last_used=datetime.fromtimestamp(ref.last_used, UTC),
            path=self._link(ref),
            file_name=ref.file_name,
            format=ref.format,
            source=ref.source,
            pinned=bool(self._pins[ref.name]),
        )

    def _recover(self) -> None:
        """Create the layout and sweep what a crash left half done (see the module's documentation)."""
        for folder in (self._blobs, self._refs_dir, self._models, self._partial):
            folder.mkdir(parents=True, exist_ok=True)
        for folder in (self._blobs, self._refs_dir, self._partial):
            for tmp in folder.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)
        for path in sorted(self._refs_dir.glob("*.json")):
            ref = _Ref.load(path)
            blob = self._blobs / ref.digest if ref is not None else None
            if ref is None or blob is None or not blob.is_file() or blob.stat().st_size != ref.size:
                log.warning("model cache: dropping the broken or orphaned ref %s", path)
                path.unlink(missing_ok=True)
                continue
            self._refs[ref.name] = ref
            self._clock = max(self._clock, ref.last_used)
        named = {r.digest for r in self._refs.values()}
        for blob in self._blobs.iterdir():
            if blob.name not in named:
                blob.unlink(missing_ok=True)
        for folder in self._models.iterdir():
            if folder.name not in self._refs:
                if folder.is_dir() and not folder.is_symlink():
                    shutil.rmtree(folder, ignore_errors=True)
                else:
                    folder.unlink(missing_ok=True)
        for ref in self._refs.values():
            if not self._link(ref).is_file():
                self._place_link(ref)
        for part in self._partial.glob("*.part"):
            if not sidecar_path(part).is_file():
                part.unlink(missing_ok=True)  # a copy, or a download that never got its headers
        for side in self._partial.glob("*.json"):
            if not side.with_suffix(".part").is_file():
                side.unlink(missing_ok=True)


def _file_name(model: Model, source: Source) -> str:
    """The name engines see: the source's file name when it is a plain one, else ``<model>.<ext>``."""
    suggested = source_file_name(source)
    if suggested and _FILE_NAME.fullmatch(suggested):
        return suggested
    return f"{model.name}.{_EXTENSIONS.get(model.format, 'bin')}"


@contextlib.contextmanager
def rich_progress(console: Console | None = None) -> Iterator[ProgressCallback]:
    """A progress callback drawing one ``rich`` bar per model, for the CLI::

    with rich_progress() as on_progress:
        cache.ensure(model, on_progress)
    """
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TaskID,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    lock = threading.Lock()
    tasks: dict[str, TaskID] = {}
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
    ) as progress:

        def on_progress(model: Model, done: int, total: int | None, rate: float) -> None:
            with lock:
                task = tasks.get(model.name)
                if task is None:
                    task = tasks[model.name] = progress.add_task(model.name, total=total)
                progress.update(task, completed=done, total=total)

        yield on_progress
