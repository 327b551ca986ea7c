"""Commands that need no control plane, or drive one locally: ``dev tiny-model`` and ``up``.

``up --model X`` serves any GGUF: ``tiny`` (written at start), a local path, an https URL or an
``hf://ORG/REPO/FILE.gguf``. A model that is not tiny is fetched first, with a progress bar, into
the model cache the agent then uses (one copy, verified, resumable after Ctrl-C). Ctrl-C and SIGTERM
both stop the agent (and its engines) and the server gracefully, and print no error.

A data directory is one control plane whatever port serves it: a later ``up`` on another port
rebinds the node's credential to its URL, and its agent registers with it. An agent whose
enrolment waits for an operator's approval is said so, with the command that approves it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console

from fleetserve.adminapi.credentials import CreatedKey, EnrolmentView
from fleetserve.adminapi.fleet import NodeView, ReplicaView
from fleetserve.agent.credential import CredentialFile
from fleetserve.cli.views import waiting_enrolments
from fleetserve.dev.tinymodel import (
    PREFILL_1S,
    TINY,
    TinyShape,
    write_tiny_embedding_model,
    write_tiny_model,
    write_tiny_reranker,
)
from fleetserve.engines.spec import Task
from fleetserve.errors import FleetserveError
from fleetserve.process import die_with_parent
from fleetserve.secretfile import private_dir, write_secret
from fleetserve.sources import LocalSource, parse_source
from fleetserve.spec.resources import Model, ModelFormat, Replica, ReplicaState

TINY_DEPLOYMENT = "tiny"


class UpError(FleetserveError):
    """``fleetserve up`` could not bring the stack up."""


@dataclass(frozen=True)
class UpOptions:
    """How ``up`` reaches models and engines (passed on to its agent)."""

    allow_private_sources: bool = False
    hf_mirror: Path | None = None
    hf_token_file: Path | None = None
    llama_server: Path | None = None
    # The server's gateway keeps its rate-limit windows in this Redis (--redis-url).
    redis_url: str | None = None
    # How long the server keeps usage and the audit log (--usage-retention, --audit-retention).
    usage_retention: str = "30d"
    audit_retention: str = "365d"
    # The origins whose web pages may call the gateway (--cors-origin; none: no CORS).
    cors_origins: tuple[str, ...] = ()
    # The server's listener and gateway limits, as its flags (--max-head-bytes ... --body-limit).
    bounds: tuple[str, ...] = ()

    def server_args(self) -> list[str]:
        args = ["--usage-retention", self.usage_retention, "--audit-retention", self.audit_retention]
        for origin in self.cors_origins:
            args += ["--cors-origin", origin]
        args += self.bounds
        return args + (["--redis-url", self.redis_url] if self.redis_url else [])

    def agent_args(self) -> list[str]:
        args = ["--allow-private-sources"] if self.allow_private_sources else []
        for flag, value in (
            ("--hf-mirror", self.hf_mirror),
            ("--hf-token-file", self.hf_token_file),
            ("--llama-server", self.llama_server),
        ):
            if value is not None:
                args += [flag, str(value.absolute())]
        return args


def model_name(source: str) -> str:
    """A deployment name from a model source: its file name without ``.gguf``, as a valid name."""
    stem = re.sub(r"\.gguf$", "", source.rstrip("/").rpartition("/")[2].partition("@")[0], flags=re.I)
    name = re.sub(r"[^a-z0-9.-]+", "-", stem.lower()).strip("-.")[:63].strip("-.")
    return name or "model"


def tiny_model(
    out: Path,
    console: Console,
    fmt: ModelFormat = ModelFormat.GGUF,
    task: Task = Task.GENERATE,
    shape: TinyShape = TINY,
) -> None:
    """Write the tiny model (a GGUF file, or a safetensors directory for vLLM) for a deployment of
    ``task`` and say how big and how fast: for embed a GGUF declaring mean pooling (the safetensors
    are the plain model, which vLLM converts); for rerank a GGUF declaring rank pooling, or a
    one-label classifier in safetensors. ``shape``: the GGUF's size (a generate model's only)."""
    started = time.perf_counter()
    if shape != TINY and (fmt is not ModelFormat.GGUF or task is not Task.GENERATE):
        raise ValueError("a size other than tiny is written for --format gguf --task generate only")
    if fmt is ModelFormat.GGUF:
        if task is Task.GENERATE:
            write_tiny_model(out, shape)
        else:
            writers = {Task.EMBED: write_tiny_embedding_model, Task.RERANK: write_tiny_reranker}
            writers[task](out)
        size = out.stat().st_size
    else:
        from fleetserve.dev.tinyhf import write_tiny_hf_model

        write_tiny_hf_model(out, classifier=task is Task.RERANK)
        size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    console.print(
        f"wrote {out} ({size / 1e6:.2f} MB) in {(time.perf_counter() - started) * 1000:.0f} ms",
        markup=False,
    )
    if shape != TINY:
        console.print(
            f"{shape.layers} layers, {shape.embed} wide, {shape.heads} heads, {shape.feed_forward} "
            f"feed-forward, {shape.context} tokens of context",
            markup=False,
        )
    if shape == PREFILL_1S:
        console.print(
            "a 2,053-token prefill took 0.88-1.24 s at llama-server --threads 1 on one core of the "
            "development machine; bench/routing.py measures this one's",
            markup=False,
        )


def _spawn(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    out = os.fdopen(fd, "ab")
    try:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent,
            env=env,
        )  # fmt: skip
    finally:
        out.close()


def _wait(
    what: str, check: Any, timeout: float, procs: list[subprocess.Popen[bytes]], logs: list[Path]
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc, log in zip(procs, logs, strict=False):
            if proc.poll() is not None:
                tail = log.read_text(errors="replace").splitlines()[-15:]
                raise UpError(f"{what}: the {log.stem} exited ({proc.returncode}):\n" + "\n".join(tail))
        result = check()
        if result:
            return result
        time.sleep(0.25)
    raise UpError(f"{what}: not done after {timeout:.0f} s (logs in {logs[0].parent})")


def fetch_model(source: str, data_dir: Path, options: UpOptions, console: Console) -> Model:
    """Fetch a GGUF into the cache the agent will use, with a progress bar; the Model to apply."""
    from fleetserve.agent.access import SourcePolicy
    from fleetserve.agent.cache import HubAccess, ModelCache
    from fleetserve.agent.cache.progress import rich_progress

    parsed = parse_source(source)
    if isinstance(parsed, LocalSource):
        source = str(parsed.path.absolute())
    name = model_name(source)
    cache = ModelCache(
        data_dir / "cache",
        hf_mirror=options.hf_mirror,
        hub_access=HubAccess.from_environment(options.hf_token_file),
        policy=SourcePolicy.strict(_model_dirs(source, data_dir), options.allow_private_sources),
    )
    model = Model(name=name, source=source, format=ModelFormat.GGUF)
    console.print(f"model   {name}: fetching {source}", markup=False, highlight=False)
    started = time.monotonic()
    with rich_progress(console) as on_progress:
        path = cache.ensure(model, on_progress)
    if path.is_dir():
        raise UpError(f"{source} is a whole repository; `up` serves one GGUF file (hf://ORG/REPO/FILE.gguf)")
    size = path.stat().st_size
    cached = next(m for m in cache.contents() if m.name == name)
    console.print(
        f"model   {name}: {size / 1e6:.1f} MB in the cache ({path}), sha256 {cached.digest[:16]}…, "
        f"{time.monotonic() - started:.1f} s",
        markup=False,
        highlight=False,
    )
    return model.model_copy(update={"size": size})


def _model_dirs(source: str, data_dir: Path) -> list[Path]:
    parsed = parse_source(source)
    dirs = [data_dir / "models"]
    if isinstance(parsed, LocalSource):
        dirs.append(parsed.path.absolute().parent)
    return dirs


def up(
    data_dir: Path,
    port: int,
    model: str | None,
    console: Console,
    ready_timeout: float,
    options: UpOptions | None = None,
) -> None:
    """Server and agent over a SQLite file in ``data_dir``; with ``--model``, serve that GGUF.

    ``data_dir`` is 0700; the tokens go to its tokens.yaml (0600), never into a log; the agent gets
    the join token in its environment, not on its command line, and enrols automatically (the
    server approves new names: it listens on loopback only)."""
    options = options or UpOptions()
    # Every process and document gets absolute paths: none depends on another's working directory.
    data_dir = private_dir(data_dir.absolute())
    # Ctrl-C, SIGTERM and a closed terminal (SIGHUP) all stop everything the same graceful way.
    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in stops}
    try:
        _up(data_dir, port, model, console, ready_timeout, options)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_stopped(signum: int, frame: object) -> None:
    # SIGTERM takes Ctrl-C's path: one graceful stop for both, never shown as an error.
    raise KeyboardInterrupt


def _up(
    data_dir: Path, port: int, model: str | None, console: Console, ready_timeout: float, options: UpOptions
) -> None:
    exe = str(Path(sys.executable).with_name("fleetserve"))
    server_url = f"http://127.0.0.1:{port}"
    token_file = data_dir / "tokens.yaml"
    logs = [data_dir / "server.log", data_dir / "agent.log"]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        served: Model | None = None
        if model is not None and model != "tiny":
            served = fetch_model(model, data_dir, options, console)
        procs.append(
            _spawn(
                [exe, "server", "--database-url", str(data_dir / "fleetserve.db"), "--port", str(port),
                 "--token-file", str(token_file), "--models-dir", str(data_dir / "server-models"),
                 "--endpoint-keys", str(data_dir / "endpoint-keys"), "--reconcile-interval", "0.5",
                 "--approve-new-nodes", *options.server_args()],
                logs[0],
            )
        )  # fmt: skip

        def healthy() -> bool:
            try:
                return httpx.get(f"{server_url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        _wait("starting the server", healthy, 60, procs, logs[:1])
        if not token_file.exists():
            raise UpError(
                f"{data_dir} already has a state store whose tokens were shown once and not kept in "
                f"{token_file}; use a new --data-dir"
            )
        tokens = yaml.safe_load(token_file.read_text(encoding="utf-8"))
        console.print(
            f"server  {server_url}   (state: {data_dir / 'fleetserve.db'}; tokens: {token_file})",
            markup=False,
        )
        # The node's credential was issued by the state store in data_dir, whatever port an earlier
        # `up` served it on: the agent keeps registering with it instead of enrolling again.
        credential = data_dir / "node-credential"
        CredentialFile(credential).rebind(server_url)
        agent_started = datetime.now(UTC)
        procs.append(
            _spawn(
                [exe, "agent", "--server", server_url, "--address", "127.0.0.1",
                 "--credential-file", str(credential),
                 "--cache-dir", str(data_dir / "cache"), "--log-dir", str(data_dir / "engine-logs"),
                 "--interval", "1", *_agent_model_dirs(served, data_dir), *options.agent_args()],
                logs[1],
                env={**os.environ, "FLEETSERVE_JOIN_TOKEN": tokens["join"]},
            )
        )  # fmt: skip
        admin = httpx.Client(
            base_url=server_url, headers={"Authorization": f"Bearer {tokens['admin']}"}, timeout=30
        )
        with admin:
            node = _await_agent(admin, token_file, agent_started, console, procs, logs, ready_timeout)
            console.print(f"agent   node {node.name}: {node.cpu.cores} cores registered", markup=False)
            if model is not None:
                _serve(admin, data_dir, console, procs, logs, ready_timeout, served)
        console.print("Ctrl-C stops everything.")
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        raise UpError("a process of the stack exited; see " + ", ".join(str(x) for x in logs))
    except KeyboardInterrupt:
        console.print("\nstopping…", markup=False)
    finally:
        # The rest of the shutdown must not be cut short by a second Ctrl-C.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    console.print("stopped: server and agent (and its engines) exited", markup=False)


def _await_agent(
    admin: httpx.Client,
    tokens: Path,
    since: datetime,
    console: Console,
    procs: list[subprocess.Popen[bytes]],
    logs: list[Path],
    patience: float,
) -> NodeView:
    """The node this run's agent registered and reported (since ``since``): a node the state store
    kept from an earlier run is not it. While the agent's enrolment waits for an operator's
    approval, say so once, with the command that approves it, and wait up to ``patience``."""
    told: set[str] = set()
    server = str(admin.base_url).rstrip("/")

    def registered() -> NodeView | None:
        for node in (NodeView.model_validate(n) for n in admin.get("/api/v1/nodes").json()):
            reported = node.status.agent.reported_at
            if reported and datetime.fromisoformat(reported) >= since:
                return node
        enrolments = [EnrolmentView.model_validate(e) for e in admin.get("/api/v1/enrolments").json()]
        for name in waiting_enrolments(enrolments, since):
            if name not in told:
                told.add(name)
                console.print(
                    f"agent   node {name}: its enrolment waits for an operator's approval (the name is "
                    "enrolled in this state store already, and the agent has no credential for it); in "
                    f"another terminal: FLEETSERVE_TOKEN_FILE={tokens} fleetserve nodes approve {name} "
                    f"--server {server}",
                    markup=False,
                    highlight=False,
                )
        return None

    try:
        node: NodeView = _wait("registering this machine", registered, 60, procs, logs)
        return node
    except UpError:
        if not told:
            raise
    approved: NodeView = _wait("an operator's approval of this machine", registered, patience, procs, logs)
    return approved


def _agent_model_dirs(served: Model | None, data_dir: Path) -> list[str]:
    dirs = [data_dir / "models"] + (_model_dirs(served.source, data_dir)[1:] if served else [])
    return [arg for d in dirs for arg in ("--model-dir", str(d))]


def _serve(
    admin: httpx.Client,
    data_dir: Path,
    console: Console,
    procs: list[subprocess.Popen[bytes]],
    logs: list[Path],
    ready_timeout: float,
    served: Model | None,
) -> None:
    if served is None:
        path = write_tiny_model(data_dir / "models" / "tiny.gguf")
        model_doc: dict[str, Any] = {"kind": "Model", "name": "tiny", "source": str(path), "format": "gguf"}
        name, shown, context, gibberish = TINY_DEPLOYMENT, f"tiny ({path})", 256, True
    else:
        model_doc = {"kind": "Model", **served.model_dump(mode="json", by_alias=True, exclude_none=True)}
        name, shown, context, gibberish = served.name, f"{served.name} ({served.source})", 2048, False
    documents = [
        model_doc,
        {
            "kind": "Deployment",
            "name": name,
            "model": name,
            "replicas": 1,
            "profiles": [{"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 2}, "context": context}],
        },
    ]
    response = admin.post("/api/v1/apply", json={"documents": documents})
    if response.status_code != 200:
        raise UpError(f"applying the {name} deployment failed: {response.text}")
    console.print(
        f"model   {shown} deployed with llama.cpp on the CPU; waiting for the engine…", markup=False
    )

    def running() -> ReplicaView | None:
        for listed in admin.get("/api/v1/replicas", params={"deployment": name}).json():
            replica = Replica.model_validate(listed)
            status = ReplicaView.model_validate(admin.get(f"/api/v1/replicas/{replica.name}").json())
            if status.state is ReplicaState.RUNNING and status.status.port:
                return status
            if status.state in (ReplicaState.FAILED, ReplicaState.CRASH_LOOP):
                raise UpError(f"replica {replica.name} is {status.state}: {status.status.stored()}")
        return None

    replica: ReplicaView = _wait("starting llama-server", running, ready_timeout, procs, logs)
    console.print(
        f"ready   replica {replica.name} (llama-server on 127.0.0.1:{replica.status.port})", markup=False
    )
    created = admin.post("/api/v1/keys", json={"name": "quickstart", "models": ["*"]})
    if created.status_code != 200:
        raise UpError(f"creating an API key failed: {created.text}")
    key = CreatedKey.model_validate(created.json()).key
    key_file = write_secret(data_dir / "api-key", key + "\n")
    gateway = f"{admin.base_url}/v1/chat/completions".replace("//v1", "/v1")
    # One real request through the gateway, so the quickstart ends with an answer, not a promise.
    hello = [{"role": "user", "content": "Hello!"}]
    request = {"model": name, "messages": hello, "max_tokens": 16}

    def answered() -> dict[str, Any] | None:
        reply = httpx.post(gateway, json=request, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        return dict(reply.json()) if reply.status_code == 200 else None

    answer = _wait("the first request through the gateway", answered, 30, procs, logs)
    usage = answer.get("usage", {})
    console.print(
        f"answer  {answer['choices'][0]['message']['content']!r} "
        f"({usage.get('completion_tokens')} tokens from llama-server, through the gateway"
        + ("; the tiny model speaks gibberish)" if gibberish else ")"),
        markup=False,
    )
    console.print(f"try (API key in {key_file}):", markup=False)
    body = json.dumps(request)
    console.print(
        f'  curl -s {gateway} -H "Authorization: Bearer $(cat {key_file})" '
        f"-H 'Content-Type: application/json' -d '{body}'",
        markup=False,
        highlight=False,
    )
