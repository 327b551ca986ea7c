"""Downloading one model: which transfer each source gets, one resume-and-retry loop, the checks.

``Downloader.download`` turns a ``Model`` into verified part files (``Landed``) that the cache then
commits; nothing here touches the store or its refs. Per source (``fleetserve.sources``):

- a local path, or ``hf://`` with an offline mirror: copied (``transfer.copy_file``);
- ``http(s)://`` and ``fleetserve://NAME``: ``transfer.fetch``, resumable; the node's credential
  and the control plane's CA go to URLs on the control plane only;
- ``hf://ORG/REPO[/FILE][@REV]`` without a mirror: the Hub through ``huggingface_hub``
  (``hub.resolve`` pins the revision to a commit, ``hub.locate`` says where each file's bytes
  are), each file moved by ``transfer.fetch`` and checked against the Hub's digest;
- ``hf://ORG/REPO`` from the mirror: its engine files copied as one unit.

Every resumable transfer goes through ``Downloader._retrying``: a connection that breaks off
(``TransferInterrupted``) is tried again up to ``attempts`` times, each attempt resuming the part
where the last one stopped; anything else fails at once. Free disk is checked before the first byte
when the size is known; a file that is not the model's ``sha256`` (or the digest its server
announced) is deleted, never committed.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fleetserve.agent.access import SourcePolicy
from fleetserve.agent.cache import hub
from fleetserve.agent.cache.layout import Layout, discard_partial, sidecar_path
from fleetserve.agent.cache.mirror import hf_mirror_file, hf_mirror_repo
from fleetserve.agent.cache.progress import Meter
from fleetserve.agent.cache.transfer import Fetched, control_plane_url, copy_file, fetch
from fleetserve.errors import (
    CacheError,
    ChecksumMismatch,
    InsufficientSpace,
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
)
from fleetserve.spec.resources import Model
from fleetserve.units import format_bytes

log = logging.getLogger("fleetserve.agent.cache")

# Free disk a download leaves untouched, beyond its own size.
DEFAULT_SPACE_MARGIN = 64 * 2**20


@dataclass(frozen=True)
class LandedFile:
    """One verified file, its source, and what that source resolved to (``hf://…@COMMIT``, or "")."""

    fetched: Fetched
    source: Source
    resolved: str = ""


@dataclass(frozen=True)
class LandedRepo:
    """A whole repository's verified files, by name, and the commit it resolved to."""

    files: tuple[tuple[str, Fetched], ...]
    resolved: str


# What a download hands the cache to commit.
Landed = LandedFile | LandedRepo


@contextlib.contextmanager
def disk_errors(model: Model, root: Path) -> Iterator[None]:
    """Turn an OSError of the cache's own disk into a CacheError (the sources' are SourceErrors)."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise InsufficientSpace(
                f"model {model.name!r} from {model.source}: the disk under the cache directory "
                f"{root} filled up during the download ({exc.strerror}); the partial file is "
                "kept and resumes once space is freed",
                needed=model.size or 0,
                free=shutil.disk_usage(root).free,
                cache_dir=str(root),
            ) from exc
        raise CacheError(f"model {model.name!r}: cannot write to the cache directory {root}: {exc}") from exc


class Downloader:
    """Fetches models into ``layout``'s partial area; see the module's documentation.

    ``control_plane`` is ``(base URL, token)``, the token being the node's credential (or a function
    returning the current one). ``hub`` names the Hub (endpoint, token); ``hf_mirror``, when set,
    replaces it with an offline directory. ``policy`` says which local directories and remote
    addresses may be read.
    """

    def __init__(
        self,
        layout: Layout,
        *,
        control_plane: tuple[str, str | Callable[[], str]] | None,
        control_plane_verify: ssl.SSLContext | bool,
        hf_mirror: Path | None,
        hub_access: hub.HubAccess,
        policy: SourcePolicy,
        attempts: int,
        timeout: float,
        space_margin: int,
    ) -> None:
        self.layout = layout
        self.control_plane = control_plane
        # How URLs on the control plane are verified (its pinned CA); others use the system's CAs.
        self.control_plane_verify = control_plane_verify
        self.hf_mirror = hf_mirror
        self.hub = hub_access
        self.policy = policy
        self.attempts = attempts
        self.timeout = timeout
        self.space_margin = space_margin

    def download(self, model: Model, meter: Meter) -> Landed:
        """``model``'s verified bytes in part files, ready to commit. Raises SourceError
        (TransferInterrupted when the connection kept breaking: the part is kept), ChecksumMismatch
        or InsufficientSpace."""
        shown = model.source or "(no source)"
        try:
            source = parse_source(model.source)
        except SourceError as exc:
            raise SourceError(f"model {model.name!r}: {exc}") from None
        meter.begin()
        try:
            if isinstance(source, HfSource | HfRepoSource) and self.hf_mirror is None:
                return self._from_hub(model, source, meter)
            if isinstance(source, HfRepoSource):
                return self._from_mirror_repo(model, source, meter)
            return self._one_file(model, source, meter)
        except TransferInterrupted:
            raise  # named by _retrying already
        except SourceError as exc:
            raise _prefixed(exc, f"model {model.name!r} from {shown}") from exc

    # --- the one retry loop -------------------------------------------------------------------------

    def _retrying(self, model: Model, what: str, attempt: Callable[[], Fetched]) -> Fetched:
        """``attempt()`` until it completes: a broken connection is tried again (the part resumes)
        up to ``attempts`` times; any other error ends it at once."""
        for n in range(1, self.attempts + 1):
            try:
                return attempt()
            except TransferInterrupted as exc:
                if n == self.attempts:
                    raise TransferInterrupted(
                        f"model {model.name!r} from {what}: {exc} (gave up after {n} attempt(s))"
                    ) from exc
                log.warning("model %s: %s; attempt %d of %d resumes", model.name, exc, n + 1, self.attempts)
        raise CacheError(f"model {model.name!r}: no download attempt was made")  # attempts >= 1

    # --- one file: local, mirror, http(s), fleetserve:// ------------------------------------------

    def _one_file(self, model: Model, source: Source, meter: Meter) -> LandedFile:
        shown = model.source or "(no source)"
        part = self.layout.part(model.name)
        fetched = self._retrying(model, shown, lambda: self._transfer(model, source, part, meter))
        if model.sha256 is not None and fetched.digest != model.sha256:
            discard_partial(part)
            raise ChecksumMismatch(model.name, shown, model.sha256, fetched.digest)
        if isinstance(source, ControlPlaneSource) and fetched.digest != fetched.announced:
            discard_partial(part)
            if fetched.announced is None:
                raise SourceError(
                    "the control plane sent no X-Sha256 digest to check the file against; "
                    "the file was deleted"
                )
            raise ChecksumMismatch(model.name, shown, fetched.announced, fetched.digest)
        meter.finish(fetched.size)
        return LandedFile(fetched, source)

    def _transfer(self, model: Model, source: Source, part: Path, meter: Meter) -> Fetched:
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
                raise SourceError("a whole repository is not one file")  # handled by download()
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

    # --- the Hugging Face Hub -----------------------------------------------------------------------

    def _from_hub(self, model: Model, source: HfSource | HfRepoSource, meter: Meter) -> Landed:
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
            return LandedFile(only, source, resolved=snapshot.source(filename))
        meter.finish(base)
        named = tuple((f.name, got) for f, got in zip(snapshot.files, fetched, strict=True))
        return LandedRepo(named, resolved=snapshot.source())

    def _hub_part(self, model: Model, filename: str | None, file: hub.HubFile) -> Path:
        if filename is not None:
            return self.layout.part(model.name)
        return self.layout.parts_dir(model.name) / f"{file.name}.part"

    def _hub_file(
        self,
        model: Model,
        snapshot: hub.HubSnapshot,
        file: hub.HubFile,
        part: Path,
        meter: Meter,
        base: int,
        total: int | None,
    ) -> Fetched:
        def on_bytes(done: int, _total: int | None) -> None:
            meter(base + done, total)

        what = snapshot.source(file.name)

        def attempt() -> Fetched:
            # Asked again each attempt: a CDN's signed URL may have expired meanwhile.
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
            except TransferInterrupted:
                raise
            except SourceError as exc:
                if "HTTP 401" in str(exc) or "HTTP 403" in str(exc):
                    raise SourceError(f"{what}: the Hub refused the download: {hub.TOKEN_HELP}") from exc
                raise

        return self._retrying(model, what, attempt)

    def _from_mirror_repo(self, model: Model, source: HfRepoSource, meter: Meter) -> LandedRepo:
        """A whole repository read from the offline mirror: its engine files, copied in as one unit."""
        if self.hf_mirror is None:
            raise SourceError("no Hugging Face mirror directory is configured")
        folder = hf_mirror_repo(self.hf_mirror, source.repo_id, source.revision, hub.ALLOW_PATTERNS)
        names = sorted(p.name for p in folder.iterdir() if hub.wanted(p.name) and p.is_file())
        if not any(n.endswith(".safetensors") for n in names):
            raise SourceError(f"the mirror's snapshot {folder} holds no safetensors weights")
        parts_dir = self.layout.parts_dir(model.name)
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
        return LandedRepo(tuple(named), resolved=f"hf://{source.repo_id}@{folder.name}")

    # --- the control plane's credential, free disk --------------------------------------------------

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
        root = self.layout.root
        free = shutil.disk_usage(root).free
        if needed + self.space_margin > free:
            raise InsufficientSpace(
                f"model {model.name!r} from {model.source}: not enough free disk in the cache directory "
                f"{root}: the download needs {format_bytes(needed)} ({needed} bytes) plus a "
                f"{format_bytes(self.space_margin)} margin, but only {format_bytes(free)} ({free} bytes) "
                "is free; nothing was written",
                needed=needed,
                free=free,
                cache_dir=str(root),
            )


def _prefixed(exc: SourceError, prefix: str) -> SourceError:
    """The same kind of error (a refusal stays a refusal), its message prefixed."""
    kind = SourceRefused if isinstance(exc, SourceRefused) else SourceError
    return kind(f"{prefix}: {exc}")
