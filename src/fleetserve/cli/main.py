"""The ``fleetserve`` console script: one typer app, one sub-module per command."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from fleetserve import __version__
from fleetserve.cli import admin
from fleetserve.cli.output import fail
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
        raise fail(err) from None


admin.register(app)
