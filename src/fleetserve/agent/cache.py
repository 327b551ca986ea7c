"""The node agent's model cache: content-addressed, verified, resumable, bounded.

Layout under the cache's root directory::

    blobs/sha256/<hex>          the weights, named by their sha256, read-only (not world-readable),
                                verified on the way in
    refs/<model>.json           model name → digest, file name(s), format, size, source, last use
    models/<model>/<file>       a relative symlink to the blob: the path engines are given, with the
                                source's file name (vLLM recognises GGUF by the ``.gguf`` suffix)
    models/<model>/             for a whole repository (``hf://ORG/REPO``): one symlink per file, and
                                the directory is what engines are given; it appears by one rename
    partial/<model>.part        a transfer in progress; ``partial/<model>.json`` makes it resumable
    partial/<model>.d/<f>.part  the same, per file of a repository

The cache's directories are 0700: only the agent's user reads the weights or the refs.

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

import errno
import logging
import os
import secrets
import shutil
import ssl
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from fleetserve.agent import hub
from fleetserve.agent.access import SourcePolicy
from fleetserve.agent.cacheref import FILE_NAME, Entry, Ref, manifest_digest
from fleetserve.agent.fetch import (
    Fetched,
    atomic_write,
    control_plane_url,
    copy_file,
    discard_partial,
    fetch,
    fsync_dir,
    hf_mirror_file,
    hf_mirror_repo,
    sidecar_path,
)
from fleetserve.errors import (
    CacheError,
    ChecksumMismatch,
    InsufficientSpace,
    ModelPinned,
    SourceError,
    SourceRefused,
    TransferInterrupted,
)
from fleetserve.sources import (
    ControlPlaneSource,
    HfRepoSource,
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
    pass

log = logging.getLogger("fleetserve.agent.cache")

# (model, done bytes, total bytes or None, bytes per second), at most ~10 times a second.
ProgressCallback = Callable[[Model, int, int | None, float], None]

# Free disk a download leaves untouched, beyond its own size.
DEFAULT_SPACE_MARGIN = 64 * 2**20
# Seconds between two progress reports of one transfer (the last one is always reported).
PROGRESS_INTERVAL = 0.1
# Blobs: readable by the agent's user and group, never by others; folders: the agent's user only.
BLOB_MODE = stat.S_IRUSR | stat.S_IRGRP
DIR_MODE = stat.S_IRWXU
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
    # A whole repository: the file names in ``path`` (a directory); empty for a single file.
    files: tuple[str, ...] = ()
    # The source pinned to what it resolved to (hf://…@COMMIT), when it differs from ``source``.
    resolved: str = ""


@dataclass(frozen=True)
class ModelStatus:
    """One model's cache state for the node's status: bytes done, total (None = unknown), rate."""

    model: str
    state: CacheState
    done: int
    total: int | None
    rate: float
    error: str | None = None
    # What is being fetched (the source), for a status that names it.
    source: str = ""


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
        self._cache._set_status(
            ModelStatus(
                self._model.name, CacheState.DOWNLOADING, done, total, rate, source=self._model.source
            )
        )
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
    any http(s) source under the same base URL, never elsewhere. ``hf://`` sources download from
    the Hub ``hub`` names (endpoint, token), or, when ``hf_mirror`` is set, are read from that local
    hub-cache directory, offline. ``policy`` says which local directories and remote addresses may
    be read (default: anything; the agent passes its own). Thread-safe; one instance per root.
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
        self.control_plane = control_plane
        # How URLs on the control plane are verified (its pinned CA); others use the system's CAs.
        self.control_plane_verify = control_plane_verify
        self.hf_mirror = hf_mirror
        self.hub = hub_access or hub.HubAccess()
        self.policy = policy or SourcePolicy()
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
        self._refs: dict[str, Ref] = {}
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
            if not self._intact(ref):
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
        if self._intact(ref):
            return ref
        link = self._link(ref)
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
        self._set_status(
            ModelStatus(model.name, CacheState.DOWNLOADING, 0, model.size, 0.0, source=model.source)
        )
        if isinstance(source, HfSource | HfRepoSource) and self.hf_mirror is None:
            try:
                return self._download_hub(model, source, meter)
            except TransferInterrupted:
                raise
            except SourceError as exc:
                raise _prefixed(exc, f"model {model.name!r} from {shown}") from exc
        if isinstance(source, HfRepoSource):
            try:
                return self._mirror_repo(model, source, meter)
            except SourceError as exc:
                raise _prefixed(exc, f"model {model.name!r} from {shown}") from exc
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
                raise _prefixed(exc, f"model {model.name!r} from {shown}") from exc
        if model.sha256 is not None and fetched.digest != model.sha256:
            discard_partial(part)
            raise ChecksumMismatch(model.name, shown, model.sha256, fetched.digest)
        if isinstance(source, ControlPlaneSource) and fetched.digest != fetched.announced:
            discard_partial(part)
            if fetched.announced is None:
                raise SourceError(
                    f"model {model.name!r} from {shown}: the control plane sent no X-Sha256 digest to check "
                    "the file against; the file was deleted"
                )
            raise ChecksumMismatch(model.name, shown, fetched.announced, fetched.digest)
        meter.finish(fetched.size)
        return self._commit(model, source, fetched)

    # --- the Hugging Face Hub -----------------------------------------------------------------------

    def _download_hub(self, model: Model, source: HfSource | HfRepoSource, meter: _Meter) -> Path:
        """A file or a whole repository from the Hub, pinned to the commit its revision names now,
        each file resumable and checked against the Hub's digest (and the model's sha256)."""
        self.policy.check_url(self.hub.base())
        filename = source.filename if isinstance(source, HfSource) else None
        if filename is None and model.sha256 is not None:
            raise SourceError(
                "sha256 names the digest of one file; a whole repository is pinned by its commit "
                "(hf://ORG/REPO@COMMIT) and checked against the Hub's digest of every file"
            )
        snapshot = hub.resolve(self.hub, source.repo_id, source.revision, filename)
        sizes = [f.size for f in snapshot.files]
        total = sum(s for s in sizes if s is not None) if None not in sizes else None
        parts = [self._hub_part(model, filename, f) for f in snapshot.files]
        if total is not None:
            have = sum(p.stat().st_size for p in parts if p.is_file() and sidecar_path(p).is_file())
            self._check_space(model, max(0, total - have))
        fetched: list[Fetched] = []
        base = 0
        for file, part in zip(snapshot.files, parts, strict=True):
            got = self._hub_file(model, snapshot, file, part, meter, base, total)
            problem = file.verify(got.digest, got.path)
            if problem is not None:
                discard_partial(part)
                expected = file.sha256 or f"git:{file.blob_id}"
                raise ChecksumMismatch(model.name, snapshot.source(file.name), expected, got.digest)
            fetched.append(got)
            base += got.size
        if filename is not None:
            only = fetched[0]
            if model.sha256 is not None and only.digest != model.sha256:
                discard_partial(only.path)
                raise ChecksumMismatch(model.name, snapshot.source(filename), model.sha256, only.digest)
            meter.finish(only.size)
            return self._commit(model, source, only, resolved=snapshot.source(filename))
        meter.finish(base)
        named = [(f.name, got) for f, got in zip(snapshot.files, fetched, strict=True)]
        return self._commit_dir(model, named, resolved=snapshot.source())

    def _hub_part(self, model: Model, filename: str | None, file: hub.HubFile) -> Path:
        if filename is not None:
            return self._partial / f"{model.name}.part"
        folder = self._partial / f"{model.name}.d"
        folder.mkdir(mode=DIR_MODE, exist_ok=True)
        return folder / f"{file.name}.part"

    def _hub_file(
        self,
        model: Model,
        snapshot: hub.HubSnapshot,
        file: hub.HubFile,
        part: Path,
        meter: _Meter,
        base: int,
        total: int | None,
    ) -> Fetched:
        def on_bytes(done: int, _total: int | None) -> None:
            meter(base + done, total)

        what = snapshot.source(file.name)
        for attempt in range(1, self.attempts + 1):
            url, headers = hub.locate(self.hub, snapshot, file)
            try:
                return fetch(
                    url,
                    part,
                    headers=headers,
                    on_bytes=on_bytes,
                    timeout=self.timeout,
                    identity=f"{what}#{file.sha256 or file.blob_id}",
                    guard=self.policy.check_url,
                )
            except TransferInterrupted as exc:
                if attempt == self.attempts:
                    raise TransferInterrupted(
                        f"model {model.name!r} from {what}: {exc} (gave up after {attempt} attempt(s))"
                    ) from exc
                log.warning(
                    "model %s: %s; attempt %d of %d resumes", model.name, exc, attempt + 1, self.attempts
                )
            except SourceError as exc:
                if "HTTP 401" in str(exc) or "HTTP 403" in str(exc):
                    raise SourceError(f"{what}: the Hub refused the download: {hub.TOKEN_HELP}") from exc
                raise
        raise CacheError(f"model {model.name!r}: no download attempt was made")  # attempts >= 1

    def _mirror_repo(self, model: Model, source: HfRepoSource, meter: _Meter) -> Path:
        """A whole repository read from the offline mirror: its engine files, copied in as one unit."""
        if self.hf_mirror is None:
            raise SourceError("no Hugging Face mirror directory is configured")
        folder = hf_mirror_repo(self.hf_mirror, source.repo_id, source.revision, hub.ALLOW_PATTERNS)
        names = sorted(p.name for p in folder.iterdir() if hub.wanted(p.name) and p.is_file())
        if not any(n.endswith(".safetensors") for n in names):
            raise SourceError(f"the mirror's snapshot {folder} holds no safetensors weights")
        parts_dir = self._partial / f"{model.name}.d"
        parts_dir.mkdir(mode=DIR_MODE, exist_ok=True)
        named: list[tuple[str, Fetched]] = []
        base = 0
        for name in names:
            done_before = base

            def on_bytes(done: int, total: int | None, done_before: int = done_before) -> None:
                meter(done_before + done, None)

            got = copy_file(folder / name, parts_dir / f"{name}.part", on_bytes=on_bytes)
            named.append((name, got))
            base += got.size
        meter.finish(base)
        return self._commit_dir(model, named, resolved=f"hf://{source.repo_id}@{folder.name}")

    def _transfer(self, model: Model, source: Source, part: Path, meter: _Meter) -> Fetched:
        def check_space(needed: int) -> None:
            self._check_space(model, needed)

        if model.size is not None:
            have = part.stat().st_size if sidecar_path(part).is_file() and part.is_file() else 0
            check_space(max(0, model.size - have))
        match source:
            case LocalSource(path):
                return copy_file(self.policy.local(path), part, on_bytes=meter, check_space=check_space)
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
                    guard=self.policy.check_url,
                    verify=self._verify_for(url),
                )
            case HfRepoSource():
                raise SourceError("a whole repository is not one file")  # handled by _download_unguarded
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

    def _store_blob_locked(self, fetched: Fetched) -> None:
        blob = self._blobs / fetched.digest
        if blob.is_file() and blob.stat().st_size == fetched.size:
            fetched.path.unlink()
        else:
            os.chmod(fetched.path, BLOB_MODE)
            os.replace(fetched.path, blob)
            fsync_dir(self._blobs)
        sidecar_path(fetched.path).unlink(missing_ok=True)

    def _commit(self, model: Model, source: Source, fetched: Fetched, resolved: str = "") -> Path:
        """Move a verified part into the store and name it; under the lock, so eviction cannot interleave."""
        with self._lock:
            self._store_blob_locked(fetched)
            ref = Ref(
                name=model.name,
                digest=fetched.digest,
                size=fetched.size,
                file_name=_file_name(model, source),
                format=model.format.value,
                source=model.source,
                last_used=self._now(),
                resolved=resolved,
            )
            return self._name_locked(ref)

    def _commit_dir(self, model: Model, named: list[tuple[str, Fetched]], resolved: str) -> Path:
        """Store a repository's verified parts and name them as one directory, which appears whole."""
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
        shutil.rmtree(self._partial / f"{model.name}.d", ignore_errors=True)
        return path

    def _name_locked(self, ref: Ref) -> Path:
        """Link a stored model, write its ref last, drop what its previous definition alone used."""
        self._place_link(ref)
        atomic_write(self._refs_dir / f"{ref.name}.json", ref.dump())
        old = self._refs.get(ref.name)
        self._refs[ref.name] = ref
        if old is not None:
            for digest in set(old.blobs()) - set(ref.blobs()):
                self._drop_blob_if_unused(digest)
        self._evict_to_cap_locked(keep=ref.name)
        return self._link(ref)

    # --- eviction -------------------------------------------------------------------------------

    def _evict_to_cap_locked(self, keep: str) -> None:
        if self.max_bytes is None:
            return
        while self._total_locked() > self.max_bytes:
            protected: set[str] = set()
            for r in self._refs.values():
                if r.name == keep or self._pins[r.name]:
                    protected.update(r.blobs())
            # A model whose blobs protected models share frees nothing: evicting it only loses it.
            candidates = [
                r
                for r in self._refs.values()
                if r.name != keep and not self._pins[r.name] and set(r.blobs()) - protected
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

    def _remove_locked(self, ref: Ref) -> None:
        (self._refs_dir / f"{ref.name}.json").unlink(missing_ok=True)
        fsync_dir(self._refs_dir)
        self._refs.pop(ref.name, None)
        shutil.rmtree(self._models / ref.name, ignore_errors=True)
        for digest in ref.blobs():
            self._drop_blob_if_unused(digest)

    def _drop_blob_if_unused(self, digest: str) -> None:
        if all(digest not in r.blobs() for r in self._refs.values()):
            (self._blobs / digest).unlink(missing_ok=True)

    def _total_locked(self) -> int:
        sizes: dict[str, int] = {}
        for r in self._refs.values():
            sizes.update(r.blobs())
        return sum(sizes.values())

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
            atomic_write(self._refs_dir / f"{ref.name}.json", touched.dump())
        except OSError as exc:  # a use that cannot be recorded still serves the model
            log.warning("model %s: cannot record its use: %s", ref.name, exc)

    def _link(self, ref: Ref) -> Path:
        """What engines are given: the file's symlink, or a repository's directory."""
        if ref.is_dir:
            return self._models / ref.name
        return self._models / ref.name / ref.file_name

    def _intact(self, ref: Ref) -> bool:
        """Whether every file engines would read is in place at its size."""
        folder = self._models / ref.name
        wanted = ref.files or (Entry(ref.file_name, ref.digest, ref.size),)
        try:
            return all((folder / e.name).stat().st_size == e.size for e in wanted)
        except OSError:
            return False

    def _place_link(self, ref: Ref) -> None:
        if ref.is_dir:
            self._place_dir(ref)
            return
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

    def _place_dir(self, ref: Ref) -> None:
        """A repository's directory of symlinks, built aside and renamed into place whole."""
        tag = secrets.token_hex(4)
        tmp = self._models / f".{ref.name}.{tag}.tmp"
        tmp.mkdir(mode=DIR_MODE)
        for entry in ref.files:
            os.symlink(Path("..", "..", "blobs", "sha256", entry.digest), tmp / entry.name)
        fsync_dir(tmp)
        target = self._models / ref.name
        old = self._models / f".{ref.name}.{tag}.old"
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.exists():
            os.rename(target, old)
        os.rename(tmp, target)
        fsync_dir(self._models)
        shutil.rmtree(old, ignore_errors=True)

    def _describe(self, ref: Ref) -> CachedModel:
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
            files=tuple(e.name for e in ref.files),
            resolved=ref.resolved,
        )

    def _recover(self) -> None:
        """Create the layout and sweep what a crash left half done (see the module's documentation)."""
        self.root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        for folder in (self._blobs.parent, self._blobs, self._refs_dir, self._models, self._partial):
            folder.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        for folder in (
            self.root,
            self._blobs.parent,
            self._blobs,
            self._refs_dir,
            self._models,
            self._partial,
        ):
            os.chmod(folder, DIR_MODE)
        for folder in (self._blobs, self._refs_dir, self._partial):
            for tmp in folder.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)
        for path in sorted(self._refs_dir.glob("*.json")):
            ref = Ref.load(path)
            if ref is None or not self._blobs_present(ref):
                log.warning("model cache: dropping the broken or orphaned ref %s", path)
                path.unlink(missing_ok=True)
                continue
            self._refs[ref.name] = ref
            self._clock = max(self._clock, ref.last_used)
        named = {d for r in self._refs.values() for d in r.blobs()}
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
            if not self._intact(ref):
                self._place_link(ref)
        for part in [*self._partial.glob("*.part"), *self._partial.glob("*.d/*.part")]:
            if not sidecar_path(part).is_file():
                part.unlink(missing_ok=True)  # a copy, or a download that never got its headers
        for side in [*self._partial.glob("*.json"), *self._partial.glob("*.d/*.json")]:
            if not side.with_suffix(".part").is_file():
                side.unlink(missing_ok=True)

    def _blobs_present(self, ref: Ref) -> bool:
        for digest, size in ref.blobs().items():
            blob = self._blobs / digest
            if not blob.is_file() or blob.stat().st_size != size:
                return False
        return True


def _prefixed(exc: SourceError, prefix: str) -> SourceError:
    """The same kind of error (a refusal stays a refusal), its message prefixed."""
    kind = SourceRefused if isinstance(exc, SourceRefused) else SourceError
    return kind(f"{prefix}: {exc}")


def _file_name(model: Model, source: Source) -> str:
    """The name engines see: the source's file name when it is a plain one, else ``<model>.<ext>``."""
    suggested = source_file_name(source)
    if suggested and FILE_NAME.fullmatch(suggested):
        return suggested
    return f"{model.name}.{_EXTENSIONS.get(model.format, 'bin')}"
