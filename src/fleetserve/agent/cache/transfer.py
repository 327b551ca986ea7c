"""Byte transfers into a part file, hashed as they pass: a local copy, and a resumable HTTP GET.

- ``copy_file``: a local path (``/abs/model.gguf``, ``file:///…``) or a mirror's file, copied; a copy
  is not resumable;
- ``fetch``: an ``http(s)://`` URL streamed with httpx, resumable: the control plane's
  ``fleetserve://NAME`` (``control_plane_url``) and the Hub's files (where ``hub.locate`` says the
  bytes are) come through it too.

Which source gets which transfer, how often a broken one is retried, and committing the part into
the store after checking its digest are ``fleetserve.agent.cache.download``'s and
``fleetserve.agent.cache.modelcache``'s jobs. An HTTP part has a JSON sidecar (``<key>.json``
beside ``<key>.part``) recording the URL, the validator (ETag or Last-Modified) and the expected
size, so the next attempt can ask for the rest with ``Range`` + ``If-Range``: a 206 resumes, a 200
(no range support, or the file changed) restarts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import ssl
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from fleetserve.agent.cache.layout import atomic_write, discard_partial, sidecar_path
from fleetserve.errors import SourceError, TransferInterrupted

# What one read or write moves at most.
CHUNK = 1 << 20
# The control plane's route for a model's file, under its base URL.
CONTROL_PLANE_FILE_PATH = "/api/v1/agent/models/{name}/file"

# (done bytes, total bytes or None), after every chunk written.
ByteCounter = Callable[[int, int | None], None]
# Raise (InsufficientSpace) when this many more bytes will not fit; called before anything is written.
SpaceCheck = Callable[[int], None]
# Raise (SourceRefused) when a URL may not be requested; called for every request, redirects included.
UrlGuard = Callable[[str], None]


def _guard_hook(guard: UrlGuard) -> Callable[[httpx.Request], None]:
    def hook(request: httpx.Request) -> None:
        guard(str(request.url))

    return hook


def control_plane_url(base_url: str, name: str) -> str:
    """The control plane's URL for a model's file."""
    return base_url.rstrip("/") + CONTROL_PLANE_FILE_PATH.format(name=name)


@dataclass(frozen=True)
class Fetched:
    """A complete part file: its path, sha256, size, and the offset a resumed transfer started from."""

    path: Path
    digest: str
    size: int
    resumed_from: int = 0
    # The sha256 the server announced for the whole file (``X-Sha256``: the control plane's), if any.
    announced: str | None = None


# --- local files ----------------------------------------------------------------------------


def copy_file(
    src: Path,
    part: Path,
    *,
    on_bytes: ByteCounter | None = None,
    check_space: SpaceCheck | None = None,
) -> Fetched:
    """Copy ``src`` into ``part``, hashing the bytes as they pass; fsynced when this returns.

    A copy is not resumable: the part gets no sidecar, so a crash leaves one the next start discards.
    """
    try:
        src_file = open(src, "rb")  # noqa: SIM115 - closed below, after the size check
    except FileNotFoundError:
        raise SourceError(f"{src}: no such file") from None
    except IsADirectoryError:
        raise SourceError(f"{src}: is a directory, not a model file") from None
    except OSError as exc:
        raise SourceError(f"{src}: cannot be read: {exc.strerror or exc}") from exc
    with src_file:
        size = os.fstat(src_file.fileno()).st_size
        if check_space is not None:
            check_space(size)
        discard_partial(part)
        digest = hashlib.sha256()
        done = 0
        if on_bytes is not None:
            on_bytes(0, size)
        try:
            with open(part, "wb") as out:
                while chunk := src_file.read(CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
                    if on_bytes is not None:
                        on_bytes(done, size)
                out.flush()
                os.fsync(out.fileno())
        except BaseException:
            part.unlink(missing_ok=True)
            raise
    return Fetched(part, digest.hexdigest(), done)


# --- HTTP -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Sidecar:
    url: str
    etag: str | None
    last_modified: str | None
    size: int | None
    sha256: str | None = None

    @property
    def validator(self) -> str | None:
        """What ``If-Range`` may carry: a strong ETag, else Last-Modified (RFC 9110 §13.1.5)."""
        if self.etag and not self.etag.startswith("W/"):
            return self.etag
        return self.last_modified

    def dump(self) -> bytes:
        doc = {
            "url": self.url,
            "etag": self.etag,
            "lastModified": self.last_modified,
            "size": self.size,
            "sha256": self.sha256,
        }
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def load(cls, path: Path) -> _Sidecar | None:
        try:
            doc: Any = json.loads(path.read_bytes())
            size = doc.get("size")
            return cls(
                url=str(doc["url"]),
                etag=doc.get("etag"),
                last_modified=doc.get("lastModified"),
                size=int(size) if size is not None else None,
                sha256=doc.get("sha256"),
            )
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None


_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)", re.IGNORECASE)


def _int_header(response: httpx.Response, name: str) -> int | None:
    value = response.headers.get(name)
    return int(value) if value is not None and value.strip().isdigit() else None


def _http_failure(url: str, response: httpx.Response, authorized: bool) -> SourceError:
    status = response.status_code
    what = f"{url} answered HTTP {status} {response.reason_phrase}".rstrip()
    if status in (401, 403):
        if authorized:
            return SourceError(f"{what}: the server refused the bearer token")
        return SourceError(f"{what}: the server wants credentials")
    if status == 404:
        return SourceError(f"{what}: no such file on the server")
    return SourceError(what)


def fetch(
    url: str,
    part: Path,
    *,
    headers: Mapping[str, str] | None = None,
    on_bytes: ByteCounter | None = None,
    check_space: SpaceCheck | None = None,
    timeout: float = 30.0,
    client: httpx.Client | None = None,
    identity: str | None = None,
    guard: UrlGuard | None = None,
    verify: ssl.SSLContext | bool = True,
) -> Fetched:
    """Download ``url`` into ``part``, resuming a partial one left by an earlier attempt.

    A part with a sidecar for the same identity (``identity``, else the URL: a signed CDN URL
    changes between attempts while the file does not) and a validator is resumed with
    ``Range: bytes=N-`` and ``If-Range``; a 206 appends, a 200 restarts from zero. ``check_space``
    is called with the bytes still to come before anything is written. ``guard`` is called with
    every URL requested, redirects included, and raises to refuse one. A broken connection raises
    TransferInterrupted and keeps the part for the next attempt. The part is complete and fsynced
    when this returns.
    """
    if client is None:
        hooks = {"request": [_guard_hook(guard)]} if guard is not None else {}
        with httpx.Client(
            timeout=httpx.Timeout(timeout), follow_redirects=True, event_hooks=hooks, verify=verify
        ) as own:
            return fetch(
                url,
                part,
                headers=headers,
                on_bytes=on_bytes,
                check_space=check_space,
                client=own,
                identity=identity,
            )
    request_headers = {"Accept-Encoding": "identity", **(headers or {})}
    authorized = any(k.lower() == "authorization" for k in request_headers)
    sidecar = _Sidecar.load(sidecar_path(part))
    have = part.stat().st_size if part.is_file() else 0
    key = identity or url
    if sidecar is None or sidecar.url != key or sidecar.validator is None or have == 0:
        discard_partial(part)
        sidecar, have = None, 0
    for _ in range(2):
        with _stream(client, url, request_headers, sidecar, have) as response:
            if response.status_code == 416 and sidecar is not None:
                if sidecar.size is not None and have == sidecar.size:
                    return _hash_complete(part, have, sidecar.sha256)
                # The range is past the server's end: the file changed. Start over.
                discard_partial(part)
                sidecar, have = None, 0
                continue
            return _receive(url, key, part, response, sidecar, have, on_bytes, check_space, authorized)
    raise SourceError(f"{url}: the server refused every range request")  # pragma: no cover


@contextlib.contextmanager
def _stream(
    client: httpx.Client, url: str, headers: dict[str, str], sidecar: _Sidecar | None, have: int
) -> Iterator[httpx.Response]:
    headers = dict(headers)
    if sidecar is not None and sidecar.validator is not None and have:
        headers["Range"] = f"bytes={have}-"
        headers["If-Range"] = sidecar.validator
    try:
        with client.stream("GET", url, headers=headers) as response:
            yield response
    except httpx.TransportError as exc:
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            raise SourceError(f"{url}: cannot connect: {exc}") from exc
        raise TransferInterrupted(f"{url}: the transfer broke off: {exc}") from exc


def _hash_complete(part: Path, size: int, announced: str | None) -> Fetched:
    digest = hashlib.sha256()
    with open(part, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return Fetched(part, digest.hexdigest(), size, resumed_from=size, announced=announced)


def _receive(
    url: str,
    key: str,
    part: Path,
    response: httpx.Response,
    sidecar: _Sidecar | None,
    have: int,
    on_bytes: ByteCounter | None,
    check_space: SpaceCheck | None,
    authorized: bool,
) -> Fetched:
    """Write the response's body into ``part`` (appending for a 206 that continues it)."""
    offset = 0
    total: int | None
    if response.status_code == 206 and sidecar is not None and have:
        match = _CONTENT_RANGE.fullmatch(response.headers.get("content-range", "").strip())
        if match is None or int(match.group(1)) != have:
            discard_partial(part)
            raise TransferInterrupted(
                f"{url}: asked for bytes {have}- but the server answered Content-Range "
                f"{response.headers.get('content-range')!r}; the partial file was discarded"
            )
        offset = have
        total = int(match.group(3)) if match.group(3) != "*" else sidecar.size
    elif response.status_code == 200:
        total = _int_header(response, "content-length")
        if response.headers.get("content-encoding", "identity").lower() != "identity":
            total = None  # the length counts encoded bytes; the body is decoded
    else:
        raise _http_failure(url, response, authorized)
    if check_space is not None:
        check_space(total - offset if total is not None else 0)
    if offset == 0:
        discard_partial(part)
        resumable = response.headers.get("content-encoding", "identity").lower() == "identity"
        new = _Sidecar(
            url=key,
            etag=response.headers.get("etag") if resumable else None,
            last_modified=response.headers.get("last-modified") if resumable else None,
            size=total,
            sha256=_announced(response),
        )
        atomic_write(sidecar_path(part), new.dump())
    digest = hashlib.sha256()
    if offset:
        with open(part, "rb") as f:
            remaining = offset
            while remaining and (chunk := f.read(min(CHUNK, remaining))):
                digest.update(chunk)
                remaining -= len(chunk)
    done = offset
    with open(part, "r+b" if offset else "wb") as out:
        out.seek(offset)
        out.truncate()
        if on_bytes is not None:
            on_bytes(done, total)
        try:
            for chunk in response.iter_bytes():
                out.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                if on_bytes is not None:
                    on_bytes(done, total)
        except httpx.TransportError as exc:
            out.flush()
            os.fsync(out.fileno())
            shown = f"{done} of {total}" if total is not None else f"{done}"
            raise TransferInterrupted(
                f"{url}: the transfer broke off after {shown} bytes ({exc}); "
                "the partial file is kept and the next attempt resumes it"
            ) from exc
        out.flush()
        os.fsync(out.fileno())
    if total is not None and done != total:
        raise TransferInterrupted(f"{url}: the server sent {done} bytes of {total}; the partial file is kept")
    announced = _announced(response) or (sidecar.sha256 if sidecar is not None else None)
    return Fetched(part, digest.hexdigest(), done, resumed_from=offset, announced=announced)


def _announced(response: httpx.Response) -> str | None:
    value = response.headers.get("x-sha256", "").strip().lower()
    return value if re.fullmatch(r"[0-9a-f]{64}", value) else None
