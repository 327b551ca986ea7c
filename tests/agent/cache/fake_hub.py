"""A Hugging Face Hub on 127.0.0.1 that answers what ``huggingface_hub`` 2.4.0 asks for a download.

Read from the client's source (``hf_api.HfApi.model_info``, ``file_download.get_hf_file_metadata``,
``utils._http.hf_raise_for_status``):

- ``GET /api/models/ORG/REPO/revision/REV?blobs=true`` (``model_info(files_metadata=True)``):
  JSON with ``id``, ``sha`` (the commit) and ``siblings`` (``rfilename``, ``size``, ``blobId``, and
  ``lfs: {sha256, size, pointerSize}`` for LFS files);
- ``HEAD /ORG/REPO/resolve/COMMIT/FILE`` (``get_hf_file_metadata``), which follows redirects only on
  the same origin: a file in git answers 200 with ``ETag`` (its git blob id), ``X-Repo-Commit`` and
  ``Content-Length``; an LFS file answers 302 to the CDN (a second server: another origin) with
  ``X-Repo-Commit``, ``X-Linked-Etag`` (its sha256) and ``X-Linked-Size``, as the real Hub does;
- ``GET`` of the same, or of the CDN's signed URL, with ``Range`` (206) and ``If-Range``;
- errors as the client reads them: ``X-Error-Code`` ``GatedRepo`` (401 without the right token),
  ``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound`` (404).

Faults: ``cut_after`` (the next body GETs are cut after N bytes, connection closed), ``corrupt``
(file names whose bytes are served altered), ``requests`` (everything asked, with headers).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")


def git_blob_id(body: bytes) -> str:
    return hashlib.sha1(f"blob {len(body)}\0".encode() + body).hexdigest()


def sha256(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


@dataclass(frozen=True)
class Seen:
    """One request either server answered."""

    server: str  # "hub" or "cdn"
    method: str
    path: str
    headers: dict[str, str]
    status: int


@dataclass
class _Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    gated: bool = False


class FakeHub:
    """The Hub (``endpoint``) and its CDN, both on loopback; see the module's documentation."""

    def __init__(self, token: str | None = None, chunk: int = 16 * 1024, delay: float = 0.0) -> None:
        self.token = token
        self.chunk = chunk
        self.delay = delay  # seconds between two chunks of a body: a slow link
        self.repos: dict[str, _Repo] = {}
        self.blobs: dict[str, bytes] = {}  # sha256 → body, what the CDN serves
        self.cut_after: list[int] = []
        self.corrupt: set[str] = set()
        self.requests: list[Seen] = []
        self._lock = threading.Lock()
        self._hub = _serve(self, "hub")
        self._cdn = _serve(self, "cdn")

    @property
    def endpoint(self) -> str:
        return _base(self._hub[0])

    @property
    def cdn(self) -> str:
        return _base(self._cdn[0])

    def add(self, repo_id: str, files: dict[str, bytes], *, branch: str = "main", gated: bool = False) -> str:
        """Commit ``files`` (the whole tree) to ``branch`` of ``repo_id``; the new commit's sha."""
        with self._lock:
            repo = self.repos.setdefault(repo_id, _Repo())
            repo.gated = repo.gated or gated
            seed = f"{repo_id}:{len(repo.commits)}:" + ",".join(
                f"{k}={sha256(v)}" for k, v in sorted(files.items())
            )
            commit = hashlib.sha1(seed.encode()).hexdigest()
            repo.commits[commit] = dict(files)
            repo.branches[branch] = commit
            for name, body in files.items():
                if name.endswith(LFS_SUFFIXES):
                    self.blobs[sha256(body)] = body
            return commit

    def seen(self, server: str | None = None, method: str | None = None) -> list[Seen]:
        with self._lock:
            return [
                r
                for r in self.requests
                if (server is None or r.server == server) and (method is None or r.method == method)
            ]

    def record(self, seen: Seen) -> None:
        with self._lock:
            self.requests.append(seen)

    def next_cut(self) -> int | None:
        with self._lock:
            return self.cut_after.pop(0) if self.cut_after else None

    def close(self) -> None:
        for httpd, thread in (self._hub, self._cdn):
            httpd.shutdown()
            httpd.server_close()
            thread.join(timeout=5)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: FakeHub
    role: str

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hangs up mid-body is expected here


def _serve(owner: FakeHub, role: str) -> tuple[_Server, threading.Thread]:
    httpd = _Server(("127.0.0.1", 0), _Handler)
    httpd.owner, httpd.role = owner, role
    thread = threading.Thread(target=httpd.serve_forever, args=(0.02,), name=f"fake-{role}", daemon=True)
    thread.start()
    return httpd, thread


def _base(httpd: _Server) -> str:
    host, port = httpd.server_address[:2]
    return f"http://{host!s}:{port}"


_API = re.compile(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/?]+))?")
_RESOLVE = re.compile(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)")
_CDN = re.compile(r"/cdn/([0-9a-f]{64})")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    # --- answering ------------------------------------------------------------------------------

    def _record(self, status: int) -> None:
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.server.owner.record(Seen(self.server.role, self.command, self.path, headers, status))

    def _reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self._record(status)
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, extra: dict[str, str] | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        headers = {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message}
        self._reply(status, body, {**headers, **(extra or {})})

    def _route(self) -> None:
        path = urlsplit(self.path).path
        if self.server.role == "cdn":
            match = _CDN.fullmatch(path)
            body = self.server.owner.blobs.get(match.group(1)) if match else None
            if body is None:
                self._reply(404, b"no such object")
                return
            self._body(body, f'"{match.group(1)}"' if match else "", {})
            return
        if match := _API.fullmatch(path):
            self._model_info(match.group(1), unquote(match.group(2) or "main"))
        elif match := _RESOLVE.fullmatch(path):
            self._resolve(match.group(1), unquote(match.group(2)), unquote(match.group(3)))
        else:
            self._reply(404, b"not found")

    def _repo(self, repo_id: str, revision: str) -> tuple[_Repo, str] | None:
        """The repository and the commit ``revision`` names, or None once an error was answered."""
        hub = self.server.owner
        repo = hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        if repo.gated and self.headers.get("Authorization") != f"Bearer {hub.token}":
            self._error(
                401,
                "GatedRepo",
                f"Access to model {repo_id} is restricted. You must have access to it and be authenticated.",
            )
            return None
        commit = revision if revision in repo.commits else repo.branches.get(revision)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo, commit

    def _model_info(self, repo_id: str, revision: str) -> None:
        found = self._repo(repo_id, revision)
        if found is None:
            return
        repo, commit = found
        siblings = []
        for name, body in sorted(repo.commits[commit].items()):
            sibling: dict[str, Any] = {"rfilename": name, "size": len(body), "blobId": git_blob_id(body)}
            if name.endswith(LFS_SUFFIXES):
                sibling["lfs"] = {"sha256": sha256(body), "size": len(body), "pointerSize": 134}
            siblings.append(sibling)
        doc = {
            "_id": secrets.token_hex(12),
            "id": repo_id,
            "modelId": repo_id,
            "sha": commit,
            "private": False,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": ["gguf"],
            "lastModified": "2026-11-30T12:00:00.000Z",
            "createdAt": "2026-11-01T12:00:00.000Z",
            "siblings": siblings,
        }
        self._reply(200, json.dumps(doc).encode(), {"Content-Type": "application/json"})

    def _resolve(self, repo_id: str, revision: str, filename: str) -> None:
        found = self._repo(repo_id, revision)
        if found is None:
            return
        repo, commit = found
        body = repo.commits[commit].get(filename)
        if body is None:
            self._error(404, "EntryNotFound", f"{filename} does not exist", {"X-Repo-Commit": commit})
            return
        hub = self.server.owner
        if filename.endswith(LFS_SUFFIXES):
            digest = sha256(body)
            self._reply(
                302,
                b"",
                {
                    "Location": f"{hub.cdn}/cdn/{digest}?sig={secrets.token_hex(8)}",
                    "X-Repo-Commit": commit,
                    "X-Linked-Etag": f'"{digest}"',
                    "X-Linked-Size": str(len(body)),
                    "ETag": f'"{git_blob_id(body)}"',
                },
            )
            return
        self._body(body, f'"{git_blob_id(body)}"', {"X-Repo-Commit": commit}, name=filename)

    def _body(self, body: bytes, etag: str, headers: dict[str, str], name: str = "") -> None:
        hub = self.server.owner
        if self.server.role == "cdn":
            digest = etag.strip('"')
            name = next(
                (
                    n
                    for r in hub.repos.values()
                    for f in r.commits.values()
                    for n, b in f.items()
                    if sha256(b) == digest
                ),
                "",
            )
        if name in hub.corrupt:
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        start, status = 0, 200
        wanted = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        if_range = self.headers.get("If-Range")
        if wanted and (if_range is None or if_range == etag):
            start, status = int(wanted.group(1)), 206
            if start >= len(body):
                self._reply(416, b"", {"Content-Range": f"bytes */{len(body)}"})
                return
        data = body[start:]
        self._record(status)
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("ETag", etag)
        self.send_header("Accept-Ranges", "bytes")
        for key, value in headers.items():
            self.send_header(key, value)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        self.end_headers()
        if self.command == "HEAD":
            return
        cut = hub.next_cut()
        limit = len(data) if cut is None else min(cut, len(data))
        sent = 0
        while sent < limit:
            piece = data[sent : min(sent + hub.chunk, limit)]
            self.wfile.write(piece)
            self.wfile.flush()
            sent += len(piece)
            if hub.delay:
                time.sleep(hub.delay)
        if limit < len(data):
            self.close_connection = True
