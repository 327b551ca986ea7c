"""Helpers for the model cache's tests: a real HTTP file server, a Hugging Face mirror on disk, the
cache's files as a listing, and a progress recorder."""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from fleetserve.agent.cache import CacheState, ModelCache
from fleetserve.spec.resources import Model


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def payload(size: int, seed: int = 0) -> bytes:
    """Deterministic, non-repeating bytes (so a resumed transfer stitched at the wrong offset shows)."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(f"{seed}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:size])


@dataclass(frozen=True)
class Seen:
    """One request the server answered."""

    method: str
    path: str
    headers: dict[str, str]
    status: int


@dataclass
class FileServer:
    """An HTTP/1.1 file server on 127.0.0.1 with ``Range``/``If-Range``/ETag support and faults.

    ``cut_after``: body bytes after which each of the next GET responses is cut (connection closed).
    ``advertise``: path → a Content-Length to claim instead of the real one (the body is cut short).
    ``token``: when set, every request needs ``Authorization: Bearer <token>`` (else 401).
    """

    ranges: bool = True
    etag: bool = True
    last_modified: bool = True
    token: str | None = None
    chunk: int = 16 * 1024
    delay: float = 0.0
    files: dict[str, bytes] = field(default_factory=dict)
    cut_after: list[int] = field(default_factory=list)
    advertise: dict[str, int] = field(default_factory=dict)
    # path → the X-Sha256 to announce instead of the body's (the control plane announces its digest).
    announce: dict[str, str] = field(default_factory=dict)
    # path → a URL to redirect to (302).
    redirects: dict[str, str] = field(default_factory=dict)
    requests: list[Seen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.owner = self
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.02,), name="file-server", daemon=True
        )
        self._thread.start()

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def etag_of(self, body: bytes) -> str:
        return f'"{sha256(body)[:16]}"'

    def gets(self) -> list[Seen]:
        with self._lock:
            return [r for r in self.requests if r.method == "GET"]

    def record(self, seen: Seen) -> None:
        with self._lock:
            self.requests.append(seen)

    def next_cut(self) -> int | None:
        with self._lock:
            return self.cut_after.pop(0) if self.cut_after else None

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: FileServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hangs up mid-body (the disk-full refusal) is expected here


_LAST_MODIFIED = formatdate(time.time() - 3600, usegmt=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    def _reply(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self._record(status)  # before answering: a client may act on the answer at once
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _record(self, status: int) -> None:
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.server.owner.record(Seen(self.command, self.path, headers, status))

    def _serve(self, *, head: bool) -> None:
        fs = self.server.owner
        if fs.token is not None and self.headers.get("Authorization") != f"Bearer {fs.token}":
            self._reply(401, b'{"error": "invalid join token"}', {"Content-Type": "application/json"})
            return
        if self.path in fs.redirects:
            self._reply(302, b"", {"Location": fs.redirects[self.path]})
            return
        body = fs.files.get(self.path)
        if body is None:
            self._reply(404, b"not found")
            return
        etag = fs.etag_of(body)
        start, status = 0, 200
        wanted = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        if_range = self.headers.get("If-Range")
        validators = {etag if fs.etag else None, _LAST_MODIFIED if fs.last_modified else None}
        if fs.ranges and wanted and (if_range is None or if_range in validators):
            start, status = int(wanted.group(1)), 206
            if start >= len(body):
                self._reply(416, b"", {"Content-Range": f"bytes */{len(body)}"})
                return
        data = body[start:]
        self._record(status)
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(fs.advertise.get(self.path, len(data))))
        if fs.etag:
            self.send_header("ETag", etag)
        if fs.last_modified:
            self.send_header("Last-Modified", _LAST_MODIFIED)
        if fs.ranges:
            self.send_header("Accept-Ranges", "bytes")
        self.send_header("X-Sha256", fs.announce.get(self.path, sha256(body)))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        self.end_headers()
        if head:
            return
        cut = fs.next_cut()
        if self.path in fs.advertise:
            cut = min(cut if cut is not None else len(data), 1024)
        limit = len(data) if cut is None else min(cut, len(data))
        sent = 0
        while sent < limit:
            piece = data[sent : min(sent + fs.chunk, limit)]
            self.wfile.write(piece)
            self.wfile.flush()
            sent += len(piece)
            if fs.delay:
                time.sleep(fs.delay)
        if limit < len(data) or self.path in fs.advertise:
            self.close_connection = True


def build_hf_mirror(
    mirror: Path,
    repo_id: str,
    files: dict[str, bytes],
    *,
    commit: str = "c0ffee" * 6 + "c0ff",
    branch: str = "main",
) -> str:
    """Lay out ``files`` as the hub cache does: blobs by sha256, a snapshot of symlinks, refs/<branch>."""
    repo = mirror / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / sha256(data)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs" / branch).write_text(commit)
    return commit


# The file the test server serves at /models/tiny.gguf and at the control plane's path.
BODY = payload(300_000)
DIGEST = sha256(BODY)
CONTROL_PATH = "/api/v1/agent/models/tiny/file"


def store_files(root: Path) -> dict[str, list[str]]:
    """What the cache holds on disk, per area (temporary and hidden files included)."""
    return {
        area: sorted(str(p.relative_to(root / area)) for p in (root / area).rglob("*") if not p.is_dir())
        for area in ("blobs", "refs", "models", "partial")
    }


EMPTY: dict[str, list[str]] = {"blobs": [], "refs": [], "models": [], "partial": []}


@dataclass
class Recorder:
    """A progress callback that records every call (and, given the cache, its status at that time)."""

    calls: list[tuple[str, int, int | None, float, float]] = field(default_factory=list)
    statuses: list[list[tuple[str, CacheState]]] = field(default_factory=list)
    cache: ModelCache | None = None

    def __call__(self, model: Model, done: int, total: int | None, rate: float) -> None:
        self.calls.append((model.name, done, total, rate, time.monotonic()))
        if self.cache is not None:
            self.statuses.append([(s.model, s.state) for s in self.cache.status()])
