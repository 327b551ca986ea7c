"""A LABELLED FAKE of the few Kubernetes API endpoints fleetserve uses, over real HTTP on 127.0.0.1.

No Kubernetes API server can run on this machine: there is no container runtime and no
kube-apiserver binary (nor kind, k3s or envtest). This stands in for the endpoints
``fleetserve.kube.apply`` and ``fleetserve.kube.importer`` call, so their tests go through the
official ``kubernetes`` client for real: kubeconfig loading, URL building, query parameters,
content types, JSON (de)serialization and HTTP error handling. It is NOT Kubernetes: no
validation, no defaulting, no field ownership (a server-side apply patch replaces the stored
object; merging is not modelled), no watches, no admission.

What it serves (a ``ThreadingHTTPServer`` in a daemon thread):

- ``PATCH`` of the kinds ``fleetserve.kube.apply.PATCHERS`` writes (Namespace, ConfigMap, Service,
  apps/v1 Deployment, resource.k8s.io/v1 ResourceClaimTemplate, leaderworkerset.x-k8s.io/v1
  LeaderWorkerSet), content type ``application/apply-patch+yaml`` only (415 otherwise);
  ``fieldManager`` is required (400 without); ``dryRun=All`` answers without storing; a name in
  ``conflicts`` answers 409 unless ``force=true``. The answer is the object with
  ``metadata.resourceVersion``/``uid``/``creationTimestamp`` set.
- ``GET`` of one object (404 when absent) and of lists (``apiVersion``, ``kind``, ``metadata``,
  ``items``), with ``labelSelector`` equality filtering (``k=v,k2=v2``): nodes, resourceslices,
  and the namespaced lists ``read_existing`` uses; pods (``kube.exporters``), in one namespace or
  all (``/api/v1/pods``).
- ``lws_crd = False`` makes every ``leaderworkerset.x-k8s.io`` path answer 404, as a cluster
  without the LeaderWorkerSet CRD does; ``dra_api = False`` does the same for
  ``resource.k8s.io``.
- A bearer token is required (401 without); errors are ``Status`` objects like the real API's.

Every request is recorded in ``requests`` (method, path, query, content type, parsed body).
"""

from __future__ import annotations

import copy
import json
import re
import threading
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

from loopback_http import serving_on_loopback

APPLY_PATCH = "application/apply-patch+yaml"
TOKEN = "fake-apiserver-token"


@dataclass(frozen=True)
class Kind:
    """One resource type the fake serves: where it lives and whether fleetserve may apply it."""

    api_version: str
    kind: str
    plural: str
    namespaced: bool
    patchable: bool


KINDS: tuple[Kind, ...] = (
    Kind("v1", "Namespace", "namespaces", False, True),
    Kind("v1", "ConfigMap", "configmaps", True, True),
    Kind("v1", "Service", "services", True, True),
    Kind("v1", "Node", "nodes", False, False),
    Kind("v1", "Pod", "pods", True, False),
    Kind("apps/v1", "Deployment", "deployments", True, True),
    Kind("resource.k8s.io/v1", "ResourceClaimTemplate", "resourceclaimtemplates", True, True),
    Kind("resource.k8s.io/v1", "ResourceSlice", "resourceslices", False, False),
    Kind("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "leaderworkersets", True, True),
)
_BY_PATH = {(k.api_version, k.plural): k for k in KINDS}
_BY_KIND = {(k.api_version, k.kind): k for k in KINDS}

_PATH = re.compile(
    r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
    r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?$"
)


@dataclass(frozen=True)
class Request:
    """One request as the fake received it; ``query`` keeps the last value of each parameter."""

    method: str
    path: str
    query: Mapping[str, str]
    content_type: str
    body: Any


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _selector_matches(selector: str, labels: Mapping[str, str]) -> bool:
    """Equality-based selectors only (``k=v``, ``k==v``, ``k!=v``, comma-separated)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        else:
            raise ApiError(400, "BadRequest", f"the fake supports only k=v selectors, not {term!r}")
    return True


@dataclass
class FakeApiServer:
    """The fake's state: stored objects, the requests it saw, and the switches tests turn."""

    objects: dict[tuple[str, str, str, str], dict[str, Any]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    conflicts: set[str] = field(default_factory=set)
    lws_crd: bool = True
    dra_api: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock)
    port: int = 0
    _counter: int = 0

    # --- what tests call -----------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, obj: Mapping[str, Any]) -> None:
        """Store an object as if it existed in the cluster (``apiVersion`` and ``kind`` required)."""
        kind = _BY_KIND[(str(obj["apiVersion"]), str(obj["kind"]))]
        meta = obj.get("metadata") or {}
        ns = str(meta.get("namespace", "")) if kind.namespaced else ""
        with self.lock:
            self.objects[(kind.api_version, kind.plural, ns, str(meta["name"]))] = self._stamp(obj, ns)

    def stored(self, api_version: str, kind: str, name: str, namespace: str = "") -> dict[str, Any] | None:
        k = _BY_KIND[(api_version, kind)]
        return self.objects.get((api_version, k.plural, namespace if k.namespaced else "", name))

    def write_kubeconfig(self, path: Path, token: str = TOKEN) -> Path:
        """A kubeconfig naming this server (plain HTTP) and a token user."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        }
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        return path

    def patches(self) -> list[Request]:
        return [r for r in self.requests if r.method == "PATCH"]

    # --- the API ----------------------------------------------------------------------------

    def _stamp(self, obj: Mapping[str, Any], ns: str) -> dict[str, Any]:
        out = copy.deepcopy(dict(obj))
        meta = dict(out.get("metadata") or {})
        self._counter += 1
        meta["resourceVersion"] = str(1000 + self._counter)
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        if ns:
            meta["namespace"] = ns
        out["metadata"] = meta
        return out

    def _route(self, path: str) -> tuple[Kind, str, str | None]:
        m = _PATH.match(path)
        if not m:
            raise ApiError(404, "NotFound", f"the fake serves no {path}")
        api_version = "v1" if m["core"] else f"{m['group']}/{m['version']}"
        if api_version.startswith("leaderworkerset.x-k8s.io/") and not self.lws_crd:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if api_version.startswith("resource.k8s.io/") and not self.dra_api:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        kind = _BY_PATH.get((api_version, m["plural"]))
        if kind is None:
            raise ApiError(404, "NotFound", f"the fake serves no {api_version} {m['plural']}")
        ns = m["ns"] or ""
        if kind.namespaced != bool(ns) and m["name"] is not None:
            raise ApiError(404, "NotFound", f"{kind.kind} is {'' if kind.namespaced else 'not '}namespaced")
        return kind, ns, m["name"]

    def handle(self, method: str, path: str, query: Mapping[str, str], ctype: str, body: Any) -> Any:
        kind, ns, name = self._route(path)
        if method == "GET":
            return self._get(kind, ns, name, query)
        if method == "PATCH":
            return self._patch(kind, ns, name, query, ctype, body)
        raise ApiError(405, "MethodNotAllowed", f"the fake does not serve {method}")

    def _get(self, kind: Kind, ns: str, name: str | None, query: Mapping[str, str]) -> Any:
        with self.lock:
            if name is not None:
                obj = self.objects.get((kind.api_version, kind.plural, ns, name))
                if obj is None:
                    raise ApiError(404, "NotFound", f'{kind.plural} "{name}" not found')
                return obj
            selector = query.get("labelSelector", "")
            items = [
                obj
                for (api_version, plural, obj_ns, _), obj in sorted(self.objects.items())
                if api_version == kind.api_version
                and plural == kind.plural
                and (not ns or obj_ns == ns)
                and _selector_matches(selector, (obj.get("metadata") or {}).get("labels") or {})
            ]
        # Items of a built-in list come without apiVersion/kind, as the real API writes them;
        # custom resources keep theirs.
        builtin = not kind.api_version.startswith("leaderworkerset.")
        return {
            "apiVersion": kind.api_version,
            "kind": f"{kind.kind}List",
            "metadata": {"resourceVersion": str(1000 + self._counter)},
            "items": [
                {k: v for k, v in obj.items() if not builtin or k not in ("apiVersion", "kind")}
                for obj in items
            ],
        }

    def _patch(
        self, kind: Kind, ns: str, name: str | None, query: Mapping[str, str], ctype: str, body: Any
    ) -> Any:
        if name is None or not kind.patchable:
            raise ApiError(405, "MethodNotAllowed", f"the fake does not patch {kind.plural} here")
        if ctype.split(";")[0].strip() != APPLY_PATCH:
            raise ApiError(415, "UnsupportedMediaType", f"the fake takes only {APPLY_PATCH}, not {ctype!r}")
        if not query.get("fieldManager"):
            raise ApiError(400, "BadRequest", "fieldManager is required for apply requests")
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the apply patch is not an object")
        if name in self.conflicts and query.get("force") != "true":
            raise ApiError(
                409,
                "Conflict",
                f'Apply failed with 1 conflict: conflict with "kubectl-edit" using {kind.api_version}: '
                ".metadata.labels",
            )
        with self.lock:
            obj = self._stamp(body, ns)
            if query.get("dryRun") != "All":
                self.objects[(kind.api_version, kind.plural, ns, name)] = obj
        return obj


def _handler(state: FakeApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            parts = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
            ctype = self.headers.get("Content-Type", "")
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                body: Any = yaml.safe_load(raw) if raw else None  # JSON is YAML
            except yaml.YAMLError:
                body = raw.decode(errors="replace")
            state.requests.append(Request(self.command, parts.path, query, ctype, body))
            try:
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    raise ApiError(401, "Unauthorized", "Unauthorized")
                code, answer = 200, state.handle(self.command, parts.path, query, ctype, body)
            except ApiError as exc:
                code, answer = exc.code, _status(exc.code, exc.reason, exc.message)
            data = json.dumps(answer).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = do_POST = do_PUT = do_DELETE = _serve

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@contextmanager
def running_fake_apiserver() -> Iterator[FakeApiServer]:
    """Start the fake on a free port of 127.0.0.1; stopped (and its socket closed) on exit."""
    state = FakeApiServer()
    with serving_on_loopback(_handler(state), "fake-apiserver") as state.port:
        yield state
