"""``fleetserve server``, ``gateway`` and ``up``: the processes that serve the control plane and
its OpenAI-compatible gateway, their flags parsed here and handed to ``server.process`` (``up``:
to ``cli.local``, which runs a server and an agent on this machine).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console

from fleetserve.cli.options import (
    AllowPrivateSourcesOpt,
    AuditRetentionOpt,
    BodyLimitOpt,
    CorsOriginOpt,
    EndpointKeysOpt,
    ForwardedAllowOpt,
    GraceSecondsOpt,
    HeadTimeoutOpt,
    HfMirrorOpt,
    HfTokenFileOpt,
    InsecureOpt,
    KeepAliveTimeoutOpt,
    LlamaServerOpt,
    LogLevelOpt,
    MaxAnswerBytesOpt,
    MaxConnectionsOpt,
    MaxHeadBytesOpt,
    MaxHeadersOpt,
    RedisNamespaceOpt,
    RedisUrlOpt,
    TlsCertOpt,
    TlsDirOpt,
    TlsForceOpt,
    TlsKeyOpt,
    TlsSanOpt,
    UsageRetentionOpt,
    cors,
    gateway_limits,
    listen_tls,
    listener_limits,
    retention,
)
from fleetserve.cli.output import fail
from fleetserve.endpointkeys import EndpointKeys
from fleetserve.errors import FleetserveError
from fleetserve.listener import HEAD_BYTES, HEAD_TIMEOUT, HEADER_COUNT, KEEP_ALIVE, MAX_CONNECTIONS


def server_command(
    database_url: Annotated[
        str,
        typer.Option(
            "--database-url",
            envvar="FLEETSERVE_DATABASE_URL",
            help="sqlite:///PATH (or a plain path) for an embedded SQLite file, or "
            "postgresql://USER@HOST:PORT/DB for several servers sharing one state.",
        ),
    ] = "fleetserve.db",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.", min=1, max=65535)] = 8080,
    reconcile_interval: Annotated[
        float, typer.Option(help="Seconds between reconcile cycles.", min=0.05)
    ] = 2.0,
    reconciler: Annotated[
        Literal["auto", "process", "thread"],
        typer.Option(
            help="Where the reconciler runs: 'process' (a process of its own beside the server's, "
            "so a large fleet's reconcile cycles do not hold up the agents' requests; PostgreSQL "
            "only), 'thread' (inside the server process), or 'auto' (process on PostgreSQL, "
            "thread on SQLite).",
        ),
    ] = "auto",
    not_ready_after: Annotated[
        float, typer.Option(help="Seconds without a heartbeat before a node is NotReady.", min=0.1)
    ] = 40.0,
    lost_after: Annotated[
        float,
        typer.Option(
            help="Seconds without a heartbeat before a node is Lost and its replicas are placed elsewhere.",
            min=0.2,
        ),
    ] = 300.0,
    unhealthy_share: Annotated[
        float,
        typer.Option(
            help="Disruption mode: when at least this share of the fleet is silent past "
            "--not-ready-after at once (and at least --disruption-min-nodes nodes), the control plane "
            "suspects itself or the network, as Kubernetes does: it marks them NotReady but judges none "
            "Lost, re-places nothing and asks no node to register again until heartbeats resume.",
            min=0.01,
            max=1.0,
        ),
    ] = 0.55,
    disruption_min_nodes: Annotated[
        int, typer.Option(help="Silent nodes needed, at the least, for disruption mode.", min=1)
    ] = 3,
    replace_rate: Annotated[
        float,
        typer.Option(
            help="Outside disruption mode, at most this many nodes per second are judged Lost and "
            "have their replicas placed elsewhere (the longest silent first).",
            min=0.001,
        ),
    ] = 0.1,
    credential_cache_seconds: Annotated[
        float,
        typer.Option(
            help="Seconds the agents' door keeps which node a credential is, for the checks before "
            "a call is judged (whether a status report's body is read, whom a call speaks for). "
            "Every heartbeat, report and poll is still judged against the database, so a revoked "
            "credential is refused at its next call; 0 asks the database at every call.",
            min=0.0,
        ),
    ] = 15.0,
    token_file: Annotated[
        Path | None,
        typer.Option(
            help="On first start, write the new admin and join tokens to this file (0600) instead of "
            "showing them (they are shown only on a terminal, else written to ./fleetserve-tokens.yaml)."
        ),
    ] = None,
    approve_new_nodes: Annotated[
        bool,
        typer.Option(
            "--approve-new-nodes",
            help="Let join-token enrolments of NEW node names through without `fleetserve nodes "
            "approve`. A name enrolled already always needs an approval.",
        ),
    ] = False,
    node_address_allow: Annotated[
        list[str] | None,
        typer.Option(
            "--node-address-allow",
            help="CIDR: nodes may give addresses in it, not just the source address they connect "
            "from (behind NAT or a proxy). Repeatable.",
        ),
    ] = None,
    models_dir: Annotated[
        Path, typer.Option(help="Where the server keeps model files it serves to agents (fleetserve://NAME).")
    ] = Path("fleetserve-models"),
    endpoint_keys: EndpointKeysOpt = Path("fleetserve-endpoint-keys"),
    redis_url: RedisUrlOpt = None,
    redis_namespace: RedisNamespaceOpt = "fleetserve",
    cors_origin: CorsOriginOpt = None,
    grace_seconds: GraceSecondsOpt = 30.0,
    log_level: LogLevelOpt = "info",
    usage_retention: UsageRetentionOpt = "30d",
    audit_retention: AuditRetentionOpt = "365d",
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_dir: TlsDirOpt = Path("fleetserve-tls"),
    tls_san: TlsSanOpt = None,
    max_head_bytes: MaxHeadBytesOpt = HEAD_BYTES,
    max_headers: MaxHeadersOpt = HEADER_COUNT,
    head_timeout: HeadTimeoutOpt = HEAD_TIMEOUT,
    keep_alive_timeout: KeepAliveTimeoutOpt = KEEP_ALIVE,
    max_connections: MaxConnectionsOpt = MAX_CONNECTIONS,
    forwarded_allow_ips: ForwardedAllowOpt = None,
    body_limit: BodyLimitOpt = None,
    max_answer_bytes: MaxAnswerBytesOpt = "64MiB",
    tls: TlsForceOpt = False,
    insecure: InsecureOpt = False,
    kube_exporters: Annotated[
        bool,
        typer.Option(
            "--kube-exporters",
            help="Find the NVIDIA DCGM and AMD device-metrics-exporter pods through the Kubernetes "
            "API (every 30 s) and scrape them onto fleetserve_gpu_*, each pod's node as the node.",
        ),
    ] = False,
    kubeconfig: Annotated[
        Path | None,
        typer.Option(
            "--kubeconfig",
            help="With --kube-exporters: the kubeconfig (default: $KUBECONFIG, ~/.kube/config, or "
            "the pod's service account).",
        ),
    ] = None,
    kube_context: Annotated[
        str | None, typer.Option("--kube-context", help="With --kube-exporters: the kubeconfig context.")
    ] = None,
) -> None:
    """Run the control plane: admin REST API (OpenAPI at /docs), dashboard (/ui), state, reconciler.

    On first start it creates an admin token and a join token, written to --token-file (or shown
    once on a terminal); only their hashes are stored. Agents enrol with the join token and get a
    credential of their own; new names wait for `fleetserve nodes approve NAME` unless
    --approve-new-nodes. Several servers may share one PostgreSQL database: one of them (the
    holder of a lease in the database) reconciles at a time. On PostgreSQL the reconciler runs in a
    process of its own beside the server's (--reconciler), started again if it dies.

    Off loopback it serves TLS: --tls-cert/--tls-key, or a CA and certificate it generates in
    --tls-dir; it then prints the join command with the CA's pin (sha256:...). Plain HTTP off
    loopback only with --insecure.

    With --kube-exporters it also scrapes the GPU metrics exporters (NVIDIA DCGM, AMD
    device-metrics-exporter) it finds through the Kubernetes API, onto fleetserve_gpu_*.
    """
    from fleetserve.reconcile.health import DisruptionPolicy
    from fleetserve.server.agents.enrolment import EnrolmentPolicy, parse_networks
    from fleetserve.server.process import (
        ControlPlane,
        KubeAccess,
        Listen,
        ReconcilerMode,
        SharedWindows,
        heartbeat_policy,
        run_server,
    )

    if lost_after <= not_ready_after:
        raise typer.BadParameter("--lost-after must be longer than --not-ready-after")
    if (kubeconfig or kube_context) and not kube_exporters:
        raise typer.BadParameter("--kubeconfig and --kube-context go with --kube-exporters")
    try:
        enrolment = EnrolmentPolicy(approve_new_nodes, parse_networks(node_address_allow or []))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    allowed = cors(cors_origin)
    bounds = listener_limits(
        max_head_bytes, max_headers, head_timeout, keep_alive_timeout, max_connections, forwarded_allow_ips
    )
    limits = gateway_limits(body_limit, max_answer_bytes)
    control = ControlPlane(
        models_dir,
        reconcile_interval,
        heartbeat_policy(
            not_ready_after, lost_after, DisruptionPolicy(unhealthy_share, disruption_min_nodes, replace_rate)
        ),
        token_file,
        enrolment,
        retention(usage_retention, audit_retention),
        KubeAccess(kubeconfig, kube_context) if kube_exporters else None,
        EndpointKeys(endpoint_keys),
        credential_cache_seconds,
    )
    try:
        served = listen_tls(host, tls_cert, tls_key, tls_dir, tls_san, tls, insecure, "server")
        listen = Listen(host, port, log_level, served, tuple(tls_san or ()), grace_seconds, bounds)
        run_server(
            database_url,
            listen,
            control,
            SharedWindows(redis_url, redis_namespace),
            ReconcilerMode(reconciler),
            allowed,
            limits,
        )
    except FleetserveError as err:
        raise fail(err) from None


def up_command(
    model: Annotated[
        str | None,
        typer.Option(
            help="A GGUF to serve with llama.cpp on the CPU: 'tiny' (a tiny test model written at start), "
            "a local path, an https URL or hf://ORG/REPO/FILE.gguf (optionally @REVISION)."
        ),
    ] = None,
    data_dir: Annotated[Path, typer.Option(help="State, tokens, model cache and logs.")] = Path(
        ".fleetserve"
    ),
    port: Annotated[int, typer.Option(help="Control-plane port.", min=1, max=65535)] = 8080,
    ready_timeout: Annotated[float, typer.Option(help="Seconds to wait for the engine to be ready.")] = 300.0,
    allow_private_sources: AllowPrivateSourcesOpt = False,
    hf_mirror: HfMirrorOpt = None,
    hf_token_file: HfTokenFileOpt = None,
    llama_server: LlamaServerOpt = None,
    redis_url: Annotated[
        str | None,
        typer.Option(
            "--redis-url",
            envvar="FLEETSERVE_REDIS_URL",
            help="redis://HOST:PORT/DB: the server's gateway keeps its rate-limit windows there.",
        ),
    ] = None,
    cors_origin: CorsOriginOpt = None,
    usage_retention: UsageRetentionOpt = "30d",
    audit_retention: AuditRetentionOpt = "365d",
    max_head_bytes: MaxHeadBytesOpt = HEAD_BYTES,
    max_headers: MaxHeadersOpt = HEADER_COUNT,
    head_timeout: HeadTimeoutOpt = HEAD_TIMEOUT,
    keep_alive_timeout: KeepAliveTimeoutOpt = KEEP_ALIVE,
    max_connections: MaxConnectionsOpt = MAX_CONNECTIONS,
    forwarded_allow_ips: ForwardedAllowOpt = None,
    body_limit: BodyLimitOpt = None,
    max_answer_bytes: MaxAnswerBytesOpt = "64MiB",
) -> None:
    """Run the control plane and an agent on this machine over a SQLite file: the quickstart.

    With --model it fetches the GGUF (a progress bar with size, rate and time left; `tiny` is written
    instead), deploys it on the CPU with llama.cpp, waits until llama-server answers, sends one chat
    completion through the gateway and prints a curl line. Ctrl-C or SIGTERM stops everything.
    """
    from fleetserve.cli.local import UpOptions, up

    retention(usage_retention, audit_retention)  # checked here, before anything starts
    cors(cors_origin)
    bounds = listener_limits(
        max_head_bytes, max_headers, head_timeout, keep_alive_timeout, max_connections, forwarded_allow_ips
    )
    gateway_limits(body_limit, max_answer_bytes)
    passed = [f"--body-limit={setting}" for setting in body_limit or ()]
    options = UpOptions(
        allow_private_sources,
        hf_mirror,
        hf_token_file,
        llama_server,
        redis_url,
        usage_retention,
        audit_retention,
        tuple(cors_origin or ()),
        (*bounds.flags(), *passed, f"--max-answer-bytes={max_answer_bytes}"),
    )
    try:
        up(data_dir, port, model, Console(soft_wrap=True), ready_timeout, options)
    except FleetserveError as err:
        raise fail(err) from None


def gateway_command(
    database_url: Annotated[
        str,
        typer.Option(
            "--database-url", envvar="FLEETSERVE_DATABASE_URL", help="The control plane's database."
        ),
    ] = "fleetserve.db",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.", min=1, max=65535)] = 8081,
    endpoint_keys: EndpointKeysOpt = Path("fleetserve-endpoint-keys"),
    redis_url: RedisUrlOpt = None,
    redis_namespace: RedisNamespaceOpt = "fleetserve",
    cors_origin: CorsOriginOpt = None,
    access_log: Annotated[
        bool, typer.Option("--access-log", help="Log a line per request (costs CPU on the data path).")
    ] = False,
    grace_seconds: GraceSecondsOpt = 30.0,
    log_level: LogLevelOpt = "info",
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_dir: TlsDirOpt = Path("fleetserve-tls"),
    tls_san: TlsSanOpt = None,
    max_head_bytes: MaxHeadBytesOpt = HEAD_BYTES,
    max_headers: MaxHeadersOpt = HEADER_COUNT,
    head_timeout: HeadTimeoutOpt = HEAD_TIMEOUT,
    keep_alive_timeout: KeepAliveTimeoutOpt = KEEP_ALIVE,
    max_connections: MaxConnectionsOpt = MAX_CONNECTIONS,
    forwarded_allow_ips: ForwardedAllowOpt = None,
    body_limit: BodyLimitOpt = None,
    max_answer_bytes: MaxAnswerBytesOpt = "64MiB",
    tls: TlsForceOpt = False,
    insecure: InsecureOpt = False,
) -> None:
    """Run an extra OpenAI-compatible gateway process over the control plane's database.

    `fleetserve server` serves the same API under /v1 already; run more gateways (behind a load
    balancer) to scale out. Every gateway follows replica changes from the database, no restart.
    Off loopback it serves TLS as `fleetserve server` does (the same --tls-dir shares its CA).
    """
    from fleetserve.server.process import Listen, SharedWindows, run_gateway

    allowed = cors(cors_origin)
    bounds = listener_limits(
        max_head_bytes, max_headers, head_timeout, keep_alive_timeout, max_connections, forwarded_allow_ips
    )
    limits = gateway_limits(body_limit, max_answer_bytes)
    try:
        served = listen_tls(host, tls_cert, tls_key, tls_dir, tls_san, tls, insecure, "gateway")
        listen = Listen(host, port, log_level, served, tuple(tls_san or ()), grace_seconds, bounds)
        windows = SharedWindows(redis_url, redis_namespace)
        run_gateway(database_url, listen, windows, access_log, allowed, limits, EndpointKeys(endpoint_keys))
    except FleetserveError as err:
        raise fail(err) from None
