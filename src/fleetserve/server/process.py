"""How a fleetserve process is assembled and run: the control plane (``fleetserve server``) and an
extra gateway (``fleetserve gateway``).

Both open the store, build their app over one ``Serving`` (metrics, the observer scraping the
engines, the gateway whose picker reads the observer's engine load) and serve it with uvicorn.
The control plane also creates its first tokens and runs the reconciler thread, whose autoscaler
reads the same observer and gateway. The CLI parses flags and calls ``run_server`` or
``run_gateway``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from functools import partial
from pathlib import Path
from types import FrameType

import uvicorn
import yaml
from fastapi import FastAPI
from rich.console import Console
from starlette.concurrency import run_in_threadpool

from fleetserve.endpointkeys import EndpointKeys
from fleetserve.errors import ConfigError, Problem
from fleetserve.gateway.bodylimits import DEFAULT_GATEWAY_LIMITS, GatewayLimits
from fleetserve.gateway.cors import Cors
from fleetserve.listener import ListenerLimits, uvicorn_config
from fleetserve.metrics.exporters import REFRESH_SECONDS, Classes, ExporterTarget
from fleetserve.reconcile.health import DisruptionPolicy, HeartbeatPolicy
from fleetserve.secretfile import write_secret
from fleetserve.server.admin.retention import RetentionPolicy, prune_forever
from fleetserve.server.agents.credcache import DEFAULT_TTL
from fleetserve.server.agents.enrolment import EnrolmentPolicy
from fleetserve.server.app import Lifespan, Serving, create_app, create_gateway_app
from fleetserve.server.collector import collect_paced, tune_collector
from fleetserve.server.gpu_exporters import ExporterScrape
from fleetserve.server.reconciler.loop import Reconciler, holder_name
from fleetserve.server.reconciler.process import ReconcilerConfig, ReconcilerProcess
from fleetserve.server.reconciler.signals import autoscale_signals, signal_answers
from fleetserve.store.credentials import TokenKind
from fleetserve.store.db import database_url as database_url_of
from fleetserve.store.db import shown_url
from fleetserve.store.protocols import Tokens
from fleetserve.store.sql import SqlStore
from fleetserve.tls import ServerTls, is_loopback, public_host, url_of

# The exit status of a gateway whose app did not start (its lifespan failed), as ``uvicorn.run`` has it.
STARTUP_FAILURE = 3


@dataclass(frozen=True)
class Listen:
    """Where a process listens, with which TLS (None: plain HTTP), and how much it logs."""

    host: str
    port: int
    log_level: str
    tls: ServerTls | None = None
    # Extra names the certificate carries (``--tls-san``); the first names the server in joins.
    sans: tuple[str, ...] = ()
    # On SIGTERM: how long in-flight requests may take to finish before the process exits.
    grace_seconds: float = 30.0
    # What one connection may cost before it is answered (head size, timeouts, connection cap).
    limits: ListenerLimits = field(default_factory=ListenerLimits)

    @property
    def url(self) -> str:
        """The URL clients use: the listen address, or for a wildcard a name of the certificate."""
        scheme = "https" if self.tls is not None else "http"
        names = self.tls.names if self.tls is not None and self.tls.names else self.sans
        return url_of(scheme, public_host(self.host, names), self.port)


@dataclass(frozen=True)
class SharedWindows:
    """Where the gateway's rate-limit windows live: this process (no URL) or a Redis shared by all."""

    redis_url: str | None = None
    namespace: str = "fleetserve"


@dataclass(frozen=True)
class ControlPlane:
    """What only the control plane runs: the reconciler's pace and deadlines, tokens, model files,
    the enrolment policy, and how long usage and the audit log are kept."""

    models_dir: Path
    reconcile_interval: float
    policy: HeartbeatPolicy
    token_file: Path | None
    enrolment: EnrolmentPolicy = field(default_factory=EnrolmentPolicy)
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    # Find the GPU metrics exporters through this Kubernetes API and scrape them (None: do not).
    kube_exporters: KubeAccess | None = None
    # Where Endpoints' API keys are read from (``--endpoint-keys``), for the health checks and the
    # server's gateway.
    endpoint_keys: EndpointKeys = field(default_factory=EndpointKeys)
    # How long the agents' door keeps a credential's node for its checks before a call is judged
    # (``server/agents/credcache.py``; 0: asked at every call).
    credential_ttl: float = DEFAULT_TTL


@dataclass(frozen=True)
class KubeAccess:
    """Which Kubernetes API to talk to: a kubeconfig file and context (None: the defaults, or the
    pod's service account inside a cluster)."""

    kubeconfig: Path | None = None
    context: str | None = None


def kube_exporter_scrape(store: SqlStore, access: KubeAccess) -> ExporterScrape:
    """The GPU exporters of the cluster ``access`` names, found through its API every 30 s; each
    exporter pod's node is the fleetserve node of that name, whose device classes label its GPUs.
    KubeError at once when the kubeconfig cannot be loaded."""
    from fleetserve.kube.apply import api_client
    from fleetserve.kube.exporters import discover_exporters

    api = api_client(access.kubeconfig, access.context)

    said: list[str] = []

    def discover() -> list[ExporterTarget]:
        found = discover_exporters(api)
        if found.skipped != said:  # each pod that cannot be scraped, said when it changes
            for line in found.skipped:
                logging.getLogger("fleetserve.exporters").warning("%s", line)
            said[:] = found.skipped
        return found.targets

    def node_classes(names: Sequence[str]) -> dict[str, Classes]:
        wanted = set(names)
        return {
            n.name: {str(d.index): d.device_class for d in n.devices}
            for n in store.nodes()
            if n.name in wanted
        }

    return ExporterScrape(discover, node_classes)


def heartbeat_policy(
    not_ready_after: float, lost_after: float, disruption: DisruptionPolicy | None = None
) -> HeartbeatPolicy:
    """The liveness deadlines from command-line seconds, with the disruption rules."""
    return HeartbeatPolicy(
        timedelta(seconds=not_ready_after), timedelta(seconds=lost_after), disruption or DisruptionPolicy()
    )


# Where the first tokens go when no --token-file is named and the output is not a terminal.
DEFAULT_TOKEN_FILE = Path("fleetserve-tokens.yaml")


def ensure_tokens(store: Tokens, token_file: Path | None, console: Console) -> None:
    """On first start (no token of a kind was ever made), create the admin and join tokens, stored
    hashed. Their plaintext goes to ``token_file`` (0600, atomically) and never into the output,
    which is often a log file; without a file, it is shown on a terminal only, else written to
    ``DEFAULT_TOKEN_FILE``."""
    ever: set[TokenKind] = {t.kind for t in store.list_tokens()}
    created: dict[str, str] = {}
    now = datetime.now(UTC)
    for kind in (TokenKind.ADMIN, TokenKind.JOIN):
        if kind not in ever:
            created[kind.value] = store.create_token(kind, now).plaintext
    if not created:
        return
    if token_file is None and console.is_terminal:
        console.print("[bold]fleetserve: new tokens — shown this once, stored only as hashes:[/]")
        for name, plaintext in created.items():
            console.print(f"  {name} token: {plaintext}", markup=False, highlight=False)
    else:
        path = token_file or DEFAULT_TOKEN_FILE
        try:
            kept = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            kept = None
        where = write_secret(path, yaml.safe_dump({**(kept if isinstance(kept, dict) else {}), **created}))
        console.print(
            f"fleetserve: new tokens ({', '.join(created)}) written to {where} (mode 0600); "
            "only their hashes are stored",
            markup=False,
        )
    console.print("  use the admin token with FLEETSERVE_TOKEN or `fleetserve login`;", markup=False)
    console.print(
        "  agents enrol with the join token (FLEETSERVE_JOIN_TOKEN or --token-file); "
        "rotate with `fleetserve tokens`.",
        markup=False,
    )


class ReconcilerMode(StrEnum):
    """Where the control plane runs its reconciler (``--reconciler``; ``server/reconciler/process.py``)."""

    AUTO = "auto"  # a process of its own on PostgreSQL, a thread on SQLite
    PROCESS = "process"
    THREAD = "thread"


def reconciler_process(
    mode: ReconcilerMode, database_url: str, control: ControlPlane, log_level: str
) -> ReconcilerConfig | None:
    """The reconciler process's settings, or None where the reconciler runs on a thread."""
    postgres = database_url_of(database_url).get_backend_name() == "postgresql"
    if mode is ReconcilerMode.PROCESS and not postgres:
        raise ConfigError(
            [
                Problem(
                    "",
                    "--reconciler",
                    "process needs PostgreSQL: a SQLite file has one writer at a time, and a second "
                    "process would wait on its lock; use --reconciler thread (or auto) with SQLite",
                )
            ]
        )
    if mode is ReconcilerMode.THREAD or not postgres:
        return None
    return ReconcilerConfig(
        database_url, control.reconcile_interval, control.policy, holder_name(), log_level
    )


def reconciling(
    store: SqlStore, control: ControlPlane, serving: Serving, process: ReconcilerConfig | None = None
) -> Lifespan:
    """The control plane's own lifespan: the reconciler — a thread, or with ``process`` a process
    of its own — started and stopped with the app, so a SIGTERM hands the lease over before exit;
    the pruning of old usage and audit events; with the reconciler a process of its own, this
    process's paced collections (``collector.collect_paced``)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stop_reconciling: Callable[[], None]
        if process is not None:
            child = ReconcilerProcess(
                process, signal_answers(serving.observer, serving.gateway), serving.metrics
            )
            child.start()
            app.state.reconciler_process = child
            stop_reconciling = partial(child.stop, control.reconcile_interval + 10)
        else:
            stop = threading.Event()
            reconciler = Reconciler(
                store,
                policy=control.policy,
                signals=autoscale_signals(serving.observer, serving.gateway),
                metrics=serving.metrics,
            )
            loop = threading.Thread(
                target=reconciler.run_forever,
                args=(stop, control.reconcile_interval),
                name="reconciler",
                daemon=True,
            )
            loop.start()

            def stop_reconciling() -> None:
                stop.set()
                loop.join(control.reconcile_interval + 10)

        stop_pruning = asyncio.Event()
        pruning = asyncio.create_task(prune_forever(store, control.retention, stop_pruning))
        # With the reconciler's heap in its own process, this one's is requests and held polls.
        collecting = asyncio.create_task(collect_paced()) if process is not None else None
        try:
            yield
        finally:
            if collecting is not None:
                collecting.cancel()
            stop_pruning.set()
            await pruning
            await run_in_threadpool(stop_reconciling)

    return lifespan


def server_app(
    store: SqlStore,
    control: ControlPlane,
    ca_pem: bytes | None = None,
    windows: SharedWindows | None = None,
    process: ReconcilerConfig | None = None,
    cors: Cors | None = None,
    limits: GatewayLimits = DEFAULT_GATEWAY_LIMITS,
) -> FastAPI:
    """The control plane's app: admin and agents' API, gateway, observer and reconciler (a thread,
    or with ``process`` a process of its own); it publishes ``ca_pem`` (a generated CA) for
    clients that pin it, and answers browsers of ``cors``'s origins on /v1."""
    windows = windows or SharedWindows()
    exporters = (
        None if control.kube_exporters is None else kube_exporter_scrape(store, control.kube_exporters)
    )
    serving = Serving.build(
        store,
        redis_url=windows.redis_url,
        redis_namespace=windows.namespace,
        cors=cors,
        limits=limits,
        exporters=exporters,
        endpoint_keys=control.endpoint_keys,
        probe_endpoints=True,
    )
    return create_app(
        store,
        lifespan=reconciling(store, control, serving, process),
        models_dir=control.models_dir,
        serving=serving,
        ca_pem=ca_pem,
        enrolment=control.enrolment,
        credential_ttl=control.credential_ttl,
    )


def gateway_app(
    store: SqlStore,
    ca_pem: bytes | None = None,
    windows: SharedWindows | None = None,
    cors: Cors | None = None,
    limits: GatewayLimits = DEFAULT_GATEWAY_LIMITS,
    endpoint_keys: EndpointKeys | None = None,
) -> FastAPI:
    """An extra gateway's app: the same gateway, observer and ``/metrics`` as the control plane's;
    Endpoints' keys read from ``endpoint_keys`` (its own copy of the server's directory)."""
    windows = windows or SharedWindows()
    serving = Serving.build(
        store,
        redis_url=windows.redis_url,
        redis_namespace=windows.namespace,
        cors=cors,
        limits=limits,
        endpoint_keys=endpoint_keys,
    )
    return create_gateway_app(store, serving=serving, ca_pem=ca_pem)


def print_tls(listen: Listen, console: Console, what: str) -> None:
    """Say how clients verify this listener: the CA's file and pin, and the commands that use it."""
    tls = listen.tls
    if tls is None:
        if not is_loopback(listen.host):
            console.print(
                "  [bold]warning:[/] plain HTTP on a non-loopback address (--insecure): tokens, "
                "prompts and answers cross the network in the clear"
            )
        return
    if tls.pin is None:
        console.print(f"  TLS with {tls.cert_file}; clients verify it with --ca-file", markup=False)
        return
    ca_file = tls.ca_file
    console.print(f"  TLS: generated CA {ca_file}, pin {tls.pin}", markup=False, highlight=False)
    if what == "server":
        console.print(
            f"  join:  fleetserve agent --server {listen.url} --ca-hash {tls.pin}  "
            "(join token in FLEETSERVE_JOIN_TOKEN)",
            markup=False,
            highlight=False,
        )
        console.print(
            f"  admin: fleetserve login --server {listen.url} --ca-hash {tls.pin}",
            markup=False,
            highlight=False,
        )
    else:
        console.print(f"  clients: trust {ca_file} (e.g. curl --cacert {ca_file})", markup=False)


def print_cors(cors: Cors | None, console: Console) -> None:
    """Say which origins' web pages may call /v1 (nothing without CORS)."""
    if cors is not None:
        console.print(f"  CORS for /v1: {', '.join(cors.origins)}", markup=False, highlight=False)


class _DrainingServer(uvicorn.Server):
    """A uvicorn server that, on SIGTERM or SIGINT, also marks the app as stopping
    (``app.state.stopping``): long-polls answer at once instead of holding the shutdown."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.app.state.stopping = True
        super().handle_exit(sig, frame)


def serve(app: FastAPI, listen: Listen, access_log: bool) -> bool:
    """Serve ``app`` until stopped (SIGINT or SIGTERM); whether it started at all.

    On the signal uvicorn stops accepting connections, lets in-flight requests (streams too)
    finish for up to ``listen.grace_seconds``, then exits.
    """
    app.state.stopping = False
    # uvloop and httptools (bounded: ``listener``): the gateway's data path is raw ASGI, and these
    # keep uvicorn's share small.
    config = uvicorn_config(
        app,
        listen.host,
        listen.port,
        listen.limits,
        log_level=listen.log_level.lower(),
        access_log=access_log,
        timeout_graceful_shutdown=max(1, math.ceil(listen.grace_seconds)),
        ssl_certfile=str(listen.tls.cert_file) if listen.tls else None,
        ssl_keyfile=str(listen.tls.key_file) if listen.tls else None,
    )
    server = _DrainingServer(config, app)
    server.run()
    return server.started


def run_server(
    database_url: str,
    listen: Listen,
    control: ControlPlane,
    windows: SharedWindows | None = None,
    mode: ReconcilerMode = ReconcilerMode.AUTO,
    cors: Cors | None = None,
    limits: GatewayLimits = DEFAULT_GATEWAY_LIMITS,
) -> None:
    """Open (and migrate) the store, then serve the API and run the reconciler until stopped;
    with ``cors``, /v1 answers browsers of its origins."""
    process = reconciler_process(mode, database_url, control, listen.log_level)
    logging.basicConfig(
        level=listen.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if process is None:  # else paced on the event loop (``reconciling``); collector.py says why
        tune_collector()
    console = Console(soft_wrap=True)
    store = SqlStore.open(database_url)
    try:
        ensure_tokens(store, control.token_file, console)
        ca_pem = listen.tls.ca_pem if listen.tls else None
        app = server_app(store, control, ca_pem, windows, process, cors, limits)
        console.print(
            f"fleetserve server: {listen.url} (OpenAPI at /docs, dashboard at /ui), state in "
            f"{shown_url(database_url)}; reconciler in {'a process of its own' if process else 'a thread'}",
            markup=False,
        )
        print_tls(listen, console, "server")
        print_cors(cors, console)
        if control.kube_exporters is not None:
            console.print(
                "  GPU metrics exporters: found through the Kubernetes API every "
                f"{REFRESH_SECONDS:.0f} s, scraped onto fleetserve_gpu_*",
                markup=False,
            )
        serve(app, listen, access_log=False)
    finally:
        store.close()


def run_gateway(
    database_url: str,
    listen: Listen,
    windows: SharedWindows | None = None,
    access_log: bool = False,
    cors: Cors | None = None,
    limits: GatewayLimits = DEFAULT_GATEWAY_LIMITS,
    endpoint_keys: EndpointKeys | None = None,
) -> None:
    """Open the control plane's store, then serve the gateway over it until stopped; with
    ``cors``, /v1 answers browsers of its origins; Endpoints' keys from ``endpoint_keys``."""
    logging.basicConfig(
        level=listen.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    store = SqlStore.open(database_url)
    try:
        console = Console(soft_wrap=True)
        console.print(f"fleetserve gateway: {listen.url}/v1", markup=False)
        print_tls(listen, console, "gateway")
        print_cors(cors, console)
        app = gateway_app(
            store, listen.tls.ca_pem if listen.tls else None, windows, cors, limits, endpoint_keys
        )
        if not serve(app, listen, access_log=access_log):
            raise SystemExit(STARTUP_FAILURE)
    finally:
        store.close()
