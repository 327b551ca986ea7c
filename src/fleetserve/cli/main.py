"""The ``fleetserve`` console script: one typer app, one sub-module per command."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from fleetserve import __version__
from fleetserve.cli import admin
from fleetserve.cli.client import ClientError
from fleetserve.cli.output import Format
from fleetserve.cli.plan import Output, run_plan
from fleetserve.errors import ConfigError, FleetserveError

app = typer.Typer(
    name="fleetserve",
    help=(
        "Serve open-weight LLMs on a fleet of NVIDIA, AMD and CPU machines behind one "
        "OpenAI-compatible endpoint.\n\n"
        "`plan` places deployments on a fleet described in YAML and explains every decision, "
        "offline. `server` runs the control plane (admin API, state store, reconciler); "
        "`apply`, `get`, `describe`, `explain`, `cordon`, `uncordon`, `drain` and `delete` talk "
        "to it over HTTP. The node agent and the gateway arrive in later releases."
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

ServerOpt = Annotated[
    str | None,
    typer.Option(
        "--server",
        help="Control-plane URL. Default: $FLEETSERVE_SERVER, the config file, or http://127.0.0.1:8080.",
        show_default=False,
    ),
]
TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token",
        help="Admin token. Default: $FLEETSERVE_TOKEN or the config file (see `fleetserve login`).",
        show_default=False,
    ),
]
FormatOpt = Annotated[Format, typer.Option("--output", "-o", help="table, json or yaml.")]


def _fail(err: FleetserveError) -> typer.Exit:
    console = Console(stderr=True, soft_wrap=True)
    if isinstance(err, ConfigError):
        console.print(f"[red]error:[/] {len(err.problems)} problem(s) in the input:")
        for problem in err.problems:
            console.print(f"  {problem}", markup=False)
        return typer.Exit(2)
    console.print(f"error: {err}", markup=False)
    if isinstance(err, ClientError):
        for p in err.problems:
            where = " ".join(x for x in (p.get("location"), p.get("field")) if x)
            console.print(f"  {where}: {p.get('message')}", markup=False)
        return typer.Exit(2 if err.status in (400, 404, 409, 422) else 1)
    return typer.Exit(1)


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
        typer.Option(help="On first start, also write the new admin and join tokens to this file (0600)."),
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
) -> None:
    """Run the control plane: admin REST API (OpenAPI at /docs), state store, reconciler.

    On first start it creates an admin token and a join token and prints them once; only their
    hashes are stored. Several servers may share one PostgreSQL database: one of them (the
    holder of a lease in the database) reconciles at a time.
    """
    from fleetserve.cli.server_cmd import heartbeat_policy, run_server

    if lost_after <= not_ready_after:
        raise typer.BadParameter("--lost-after must be longer than --not-ready-after")
    try:
        run_server(
            database_url,
            host,
            port,
            reconcile_interval,
            heartbeat_policy(not_ready_after, lost_after),
            token_file,
            log_level,
        )
    except FleetserveError as err:
        raise _fail(err) from None


@app.command("login")
def login_command(
    server: Annotated[str, typer.Option("--server", help="Control-plane URL.")],
    token: Annotated[str, typer.Option("--token", help="The admin token the server printed on first start.")],
) -> None:
    """Check an admin token against a server and save both in the config file (0600)."""
    try:
        admin.login(server.rstrip("/"), token, Console())
    except FleetserveError as err:
        raise _fail(err) from None


@app.command("apply")
def apply_command(
    file: Annotated[list[Path], typer.Option("--file", "-f", help="YAML file(s) of documents; - for stdin.")],
    server: ServerOpt = None,
    token: TokenOpt = None,
    output: FormatOpt = Format.TABLE,
) -> None:
    """Create or update classes, fabrics, nodes, models and deployments from YAML, all or nothing.

    Every document is checked against the stored state first (references, engine rules); if any
    is invalid nothing is written and every problem is listed.
    """
    console = Console(soft_wrap=True)
    try:
        docs = admin.read_documents(file)
        with admin.client(server, token) as api:
            result = api.request("POST", "/apply", json={"documents": docs})
    except FleetserveError as err:
        raise _fail(err) from None
    if output is Format.TABLE:
        for row in result["applied"]:
            console.print(f"{row['kind'].lower()}/{row['name']} {row['result']}", markup=False)
    else:
        from fleetserve.cli.output import emit

        emit(result, output, console)


@app.command("get")
def get_command(
    kind: Annotated[str, typer.Argument(help="nodes, classes, fabrics, models, deployments or replicas.")],
    name: Annotated[str | None, typer.Argument(help="One object's name; omit to list all.")] = None,
    server: ServerOpt = None,
    token: TokenOpt = None,
    output: FormatOpt = Format.TABLE,
) -> None:
    """List objects of a kind, or show one."""
    console = Console(soft_wrap=True)
    try:
        k = admin.parse_kind(kind)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="KIND") from None
    try:
        with admin.client(server, token) as api:
            data = api.request("GET", f"/{k.value}" + (f"/{name}" if name else ""))
    except FleetserveError as err:
        raise _fail(err) from None
    admin.emit_kind(k, data, output, console)


@app.command("describe")
def describe_command(
    kind: Annotated[str, typer.Argument(help="node, class, fabric, model, deployment or replica.")],
    name: Annotated[str, typer.Argument(help="The object's name.")],
    server: ServerOpt = None,
    token: TokenOpt = None,
    output: Annotated[Format, typer.Option("--output", "-o", help="yaml or json.")] = Format.YAML,
) -> None:
    """Show everything about one object; for a deployment, its status and latest decision too."""
    console = Console(soft_wrap=True)
    try:
        k = admin.parse_kind(kind)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="KIND") from None
    try:
        with admin.client(server, token) as api:
            data = api.request("GET", f"/{k.value}/{name}")
            if k is admin.Kind.DEPLOYMENTS:
                data["explanation"] = api.request("GET", f"/deployments/{name}/explain")["decision"]
    except FleetserveError as err:
        raise _fail(err) from None
    from fleetserve.cli.output import emit

    emit(data, Format.JSON if output is Format.JSON else Format.YAML, console)


@app.command("explain")
def explain_command(
    deployment: Annotated[str, typer.Argument(help="The deployment's name.")],
    server: ServerOpt = None,
    token: TokenOpt = None,
    output: FormatOpt = Format.TABLE,
) -> None:
    """Why a deployment's replicas are where they are, or why they fit nowhere."""
    console = Console(soft_wrap=True)
    try:
        with admin.client(server, token) as api:
            data = api.request("GET", f"/deployments/{deployment}/explain")
    except FleetserveError as err:
        raise _fail(err) from None
    if output is Format.TABLE:
        admin.print_decision(data, console)
    else:
        from fleetserve.cli.output import emit

        emit(data, output, console)


def _node_action(
    action: str, node: str, server: str | None, token: str | None, body: dict[str, str] | None
) -> None:
    console = Console(soft_wrap=True)
    try:
        with admin.client(server, token) as api:
            data = api.request("POST", f"/nodes/{node}/{action}", json=body)
    except FleetserveError as err:
        raise _fail(err) from None
    extra = f"; released {', '.join(data['released'])}" if data.get("released") else ""
    past = {"cordon": "cordoned", "uncordon": "uncordoned", "drain": "drained"}[action]
    console.print(f"node/{node} {past}{extra}", markup=False)


@app.command("cordon")
def cordon_command(
    node: Annotated[str, typer.Argument(help="The node's name.")],
    reason: Annotated[str, typer.Option("--reason", help="Why: every operator who looks will see it.")],
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """Keep new replicas off a node. A re-registering agent never clears it."""
    _node_action("cordon", node, server, token, {"reason": reason})


@app.command("uncordon")
def uncordon_command(
    node: Annotated[str, typer.Argument(help="The node's name.")],
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """Let new replicas land on a node again."""
    _node_action("uncordon", node, server, token, None)


@app.command("drain")
def drain_command(
    node: Annotated[str, typer.Argument(help="The node's name.")],
    reason: Annotated[str, typer.Option("--reason", help="Why the node is drained.")] = "drained by operator",
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """Cordon a node and release its replicas, so the reconciler places them elsewhere."""
    _node_action("drain", node, server, token, {"reason": reason})


@app.command("delete")
def delete_command(
    kind: Annotated[str, typer.Argument(help="class, node, model or deployment.")],
    name: Annotated[str, typer.Argument(help="The object's name.")],
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """Delete an object. A deleted deployment's replicas are stopped by the next reconcile cycle."""
    try:
        k = admin.parse_kind(kind)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="KIND") from None
    if k in (admin.Kind.REPLICAS, admin.Kind.FABRICS):
        raise typer.BadParameter(f"{k.value} cannot be deleted here", param_hint="KIND")
    try:
        with admin.client(server, token) as api:
            api.request("DELETE", f"/{k.value}/{name}")
    except FleetserveError as err:
        raise _fail(err) from None
    Console().print(f"{k.value.rstrip('s')}/{name} deleted", markup=False)
