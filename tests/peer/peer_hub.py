"""A Hugging Face Hub on 127.0.0.1 that answers what llama-server's own ``--hf-repo`` download asks
(llama.cpp ``common/hf-cache.cpp`` and ``common/download.cpp`` at b11434), so llama.cpp's server
tests run unchanged with no network: llama-server reads the endpoint from ``MODEL_ENDPOINT`` (else
``HF_ENDPOINT``).

- ``GET /api/models/ORG/REPO/refs``: ``branches`` with ``name`` and ``targetCommit`` (40 hex);
- ``GET /api/models/ORG/REPO/tree/COMMIT?recursive=true``: the files, each ``type: file``,
  ``path``, ``size`` and ``lfs: {oid: sha256, size}`` (llama.cpp names the blob by that oid);
- ``HEAD``/``GET /ORG/REPO/resolve/REV/PATH``: the bytes with ``ETag`` and ``Content-Length``,
  ``Range`` answered 206;
- anything else: 404 with ``{"error": ...}`` (llama.cpp shows that message).

The peer suite serves the project's tiny GGUF under the repositories and file names the tests ask
for (``SERVED``), so both of its runs load the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

# What the tests ask for (tools/server/tests/utils.py): ServerProcess's default repository and file,
# and the tinyllama2 preset's repository (no file: llama-server takes its only GGUF).
SERVED: dict[str, str] = {
    "ggml-org/models": "tinyllamas/stories260K.gguf",
    "ggml-org/test-model-stories260K": "stories260K.gguf",
}

_REFS = re.compile(r"/api/models/([^/]+/[^/]+)/refs")
_TREE = re.compile(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)")
_RESOLVE = re.compile(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)")
_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class PeerHub:
    """The stand-in: ``files`` maps a repository id to ``{path: bytes}``; one commit per repo."""

    def __init__(self, files: dict[str, dict[str, bytes]]) -> None:
        self.files = files
        self.commits = {repo: hashlib.sha1(repo.encode()).hexdigest() for repo in files}
        self.asked: list[str] = []
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.owner = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="peer-hub", daemon=True)
        self._thread.start()

    @classmethod
    def serving(cls, model: bytes) -> PeerHub:
        """The Hub holding ``model`` under every repository and file of ``SERVED``."""
        return cls({repo: {path: model} for repo, path in SERVED.items()})

    @property
    def endpoint(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}/"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    @property
    def hub(self) -> PeerHub:
        owner: PeerHub = self.server.owner  # type: ignore[attr-defined]
        return owner

    def _reply(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, document: Any, status: int = 200) -> None:
        self._reply(status, json.dumps(document).encode(), {"Content-Type": "application/json"})

    def _route(self) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub.asked.append(f"{self.command} {path}")
        if (match := _REFS.fullmatch(path)) and match.group(1) in self.hub.files:
            commit = self.hub.commits[match.group(1)]
            self._json({"branches": [{"name": "main", "ref": "refs/heads/main", "targetCommit": commit}]})
        elif (match := _TREE.fullmatch(path)) and match.group(1) in self.hub.files:
            files = self.hub.files[match.group(1)]
            self._json(
                [
                    {
                        "type": "file",
                        "path": name,
                        "size": len(body),
                        "oid": hashlib.sha1(f"blob {len(body)}\0".encode() + body).hexdigest(),
                        "lfs": {
                            "oid": hashlib.sha256(body).hexdigest(),
                            "size": len(body),
                            "pointerSize": 134,
                        },
                    }
                    for name, body in files.items()
                ]
            )
        elif (match := _RESOLVE.fullmatch(path)) and match.group(3) in self.hub.files.get(match.group(1), {}):
            self._file(self.hub.files[match.group(1)][match.group(3)])
        else:
            self._json({"error": f"Repository or file not found: {path}"}, 404)

    def _file(self, body: bytes) -> None:
        headers = {"ETag": f'"{hashlib.sha256(body).hexdigest()}"', "Accept-Ranges": "bytes"}
        wanted = _RANGE.fullmatch(self.headers.get("Range", ""))
        if wanted and int(wanted.group(1)) < len(body):
            start = int(wanted.group(1))
            end = int(wanted.group(2)) if wanted.group(2) else len(body) - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{len(body)}"
            self._reply(206, body[start : end + 1], headers)
        else:
            self._reply(200, body, headers)
