"""The admin commands, which talk to a running control plane over HTTP and read its answers as
``adminapi``'s models: login, apply, get, describe, explain, cordon, uncordon, drain, delete, logs,
upload; ``rollout`` status|undo and ``credentials`` (keys, tokens, nodes) are registered with them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import BaseModel
from rich.console import Console

from fleetserve.adminapi.credentials import EnrolmentView
from fleetserve.adminapi.fleet import (
    ApplyResult,
    DrainedNode,
    Explanation,
    FleetView,
    ReplicaLogs,
    UploadedFile,
)
from fleetserve.cli import views
from fleetserve.cli.client import ApiClient, resolve, token_from_file, write_config
from fleetserve.cli.output import Format, emit, fail, plain
from fleetserve.errors import FleetserveError
from fleetserve.spec.resources import Node
from fleetserve.tls import ServerTrust

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
        help="Admin token (visible in ps: prefer the environment). Default: $FLEETSERVE_TOKEN, "
        "$FLEETSERVE_TOKEN_FILE or the config file (see `fleetserve login`).",
        show_default=False,
    ),
]
FormatOpt = Annotated[Format, typer.Option("--output", "-o", help="table, json or yaml.")]
M = TypeVar("M", bound=BaseModel)


def client(server: str | None, token: str | None) -> ApiClient:
    """A client of the control plane named by flags, environment or config file."""
    return ApiClient(resolve(server, token))


def call(server: str | None, token: str | None, method: str, path: str, **kwargs: Any) -> Any:
    """One admin API request; any failure is printed for a person and ends the command."""
    try:
        with client(server, token) as api:
            return api.request(method, path, **kwargs)
    except FleetserveError as err:
        raise fail(err) from None


def call_as(
    answer: type[M], server: str | None, token: str | None, method: str, path: str, **kwargs: Any
) -> M:
    """One admin API request, its answer read as ``answer``; any failure ends the command."""
    return answer.model_validate(call(server, token, method, path, **kwargs))


def call_all(
    answer: type[M], server: str | None, token: str | None, method: str, path: str, **kwargs: Any
) -> list[M]:
    """One admin API request answered by a list, each item read as ``answer``."""
    return [answer.model_validate(item) for item in call(server, token, method, path, **kwargs)]


def login(server: str, token: str, console: Console, trust: ServerTrust | None = None) -> None:
    """Check the credentials against the server (verified as ``trust`` says), then save them."""
    target = resolve(server, token)
    if trust is not None:
        target = replace(target, trust=trust)
    with ApiClient(target) as api:
        api.request("GET", "/classes")
    path = write_config(server, token, target.trust)
    console.print(f"logged in to {server}; saved to {path}", markup=False)


def register(app: typer.Typer) -> None:
    """Add the admin commands to ``app``."""

    @app.command("login")
    def login_command(
        server: Annotated[str, typer.Option("--server", help="Control-plane URL.")],
        token_file: Annotated[
            Path | None,
            typer.Option(
                "--token-file",
                help="A file with the admin token (or the server's tokens file). Default: $FLEETSERVE_TOKEN.",
            ),
        ] = None,
        token: Annotated[
            str | None, typer.Option("--token", help="The admin token (visible in ps: prefer --token-file).")
        ] = None,
        ca_hash: Annotated[
            str | None,
            typer.Option("--ca-hash", help="sha256:HEX, the pin of the server's CA that the server printed."),
        ] = None,
        ca_file: Annotated[
            Path | None, typer.Option("--ca-file", help="Verify the server with this CA (PEM).")
        ] = None,
        insecure: Annotated[
            bool, typer.Option("--insecure", help="Allow an http:// server on a non-loopback address.")
        ] = False,
    ) -> None:
        """Check an admin token against a server and save both in the config file (0600), with
        how to verify the server (--ca-hash, --ca-file; else the environment's or the system's CAs)."""
        try:
            secret = token or (
                token_from_file(token_file) if token_file else os.environ.get("FLEETSERVE_TOKEN")
            )
            if not secret:
                raise typer.BadParameter("give --token-file (or set FLEETSERVE_TOKEN)")
            trust = ServerTrust.of(ca_file, ca_hash, insecure) if (ca_hash or ca_file or insecure) else None
            login(server.rstrip("/"), secret, Console(), trust)
        except FleetserveError as err:
            raise fail(err) from None

    @app.command("apply")
    def apply_command(
        file: Annotated[
            list[Path], typer.Option("--file", "-f", help="YAML file(s) of documents; - for stdin.")
        ],
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
            docs = views.read_documents(file)
            with client(server, token) as api:
                result = ApplyResult.model_validate(api.request("POST", "/apply", json={"documents": docs}))
        except FleetserveError as err:
            raise fail(err) from None
        if output is Format.TABLE:
            for row in result.applied:
                console.print(f"{row.kind.lower()}/{row.name} {row.result}", markup=False)
        else:
            emit(result, output, console)

    @app.command("get")
    def get_command(
        kind: Annotated[
            str,
            typer.Argument(
                help="nodes, classes, fabrics, models, deployments, replicas, endpoints or adapters."
            ),
        ],
        name: Annotated[str | None, typer.Argument(help="One object's name; omit to list all.")] = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
        output: FormatOpt = Format.TABLE,
    ) -> None:
        """List objects of a kind, or show one."""
        console = Console(soft_wrap=True)
        try:
            k = views.parse_kind(kind)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="KIND") from None
        data: BaseModel | list[BaseModel]
        if name:
            data = call_as(views.DETAILS[k], server, token, "GET", f"/{k.value}/{name}")
        else:
            data = call_all(views.VIEWS[k], server, token, "GET", f"/{k.value}")
        views.emit_kind(k, data, output, console)
        if k is views.Kind.NODES and name is None and output is Format.TABLE:
            for line in views.fleet_lines(call_as(FleetView, server, token, "GET", "/fleet")):
                console.print(line, markup=False)
            views.print_waiting_enrolments(
                call_all(EnrolmentView, server, token, "GET", "/enrolments"), console
            )

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
            k = views.parse_kind(kind)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="KIND") from None
        try:
            with client(server, token) as api:
                data = plain(views.DETAILS[k].model_validate(api.request("GET", f"/{k.value}/{name}")))
                if k is views.Kind.DEPLOYMENTS:
                    explained = Explanation.model_validate(api.request("GET", f"/deployments/{name}/explain"))
                    data["explanation"] = plain(explained.decision)
        except FleetserveError as err:
            raise fail(err) from None
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
        data = call_as(Explanation, server, token, "GET", f"/deployments/{deployment}/explain")
        if output is Format.TABLE:
            views.print_decision(data, console)
        else:
            emit(data, output, console)

    def _node_action(
        action: str, node: str, server: str | None, token: str | None, body: dict[str, str] | None
    ) -> None:
        console = Console(soft_wrap=True)
        # Cordon and uncordon answer the node; drain adds what it released and what drains.
        data = call_as(
            DrainedNode if action == "drain" else Node,
            server,
            token,
            "POST",
            f"/nodes/{node}/{action}",
            json=body,
        )
        extra = ""
        if isinstance(data, DrainedNode) and data.released:
            extra = f"; released {', '.join(data.released)}"
        if isinstance(data, DrainedNode) and data.draining:
            extra += f"; draining {', '.join(data.draining)}"
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
        reason: Annotated[
            str, typer.Option("--reason", help="Why the node is drained.")
        ] = "drained by operator",
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Cordon a node and move its replicas away: serving ones drain (out of every route, stopped
        once their requests are done or drainSeconds passed), others are released at once; the
        reconciler places replacements elsewhere."""
        _node_action("drain", node, server, token, {"reason": reason})

    @app.command("delete")
    def delete_command(
        kind: Annotated[str, typer.Argument(help="class, node, model, deployment, endpoint or adapter.")],
        name: Annotated[str, typer.Argument(help="The object's name.")],
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Delete an object. A deleted deployment's replicas are stopped by the next reconcile cycle."""
        try:
            k = views.parse_kind(kind)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="KIND") from None
        if k in (views.Kind.REPLICAS, views.Kind.FABRICS):
            raise typer.BadParameter(f"{k.value} cannot be deleted here", param_hint="KIND")
        call(server, token, "DELETE", f"/{k.value}/{name}")
        Console().print(f"{k.value.rstrip('s')}/{name} deleted", markup=False)

    @app.command("logs")
    def logs_command(
        replica: Annotated[str, typer.Argument(help="The replica's name (see `fleetserve get replicas`).")],
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """The last lines of a replica's engine output, as its agent last reported them."""
        console = Console(soft_wrap=True)
        data = call_as(ReplicaLogs, server, token, "GET", f"/replicas/{replica}/logs")
        console.print(
            f"# {data.replica}: {data.state} ({data.message}); restarts {data.restarts}",
            markup=False,
        )
        for line in data.lines:
            console.print(line, markup=False, highlight=False)

    @app.command("upload")
    def upload_command(
        model: Annotated[str, typer.Argument(help="The Model's name (apply it first).")],
        file: Annotated[Path, typer.Argument(help="The weights file.", exists=True, dir_okay=False)],
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Upload a model's file to the control plane, which serves it to agents (source fleetserve://NAME).

        The sha256 is checked against the Model's when it names one; a mismatch keeps nothing.
        """
        from rich.progress import Progress

        console = Console(soft_wrap=True)
        size = file.stat().st_size

        def chunks(progress: Progress, task: Any) -> Iterator[bytes]:
            with file.open("rb") as handle:
                while chunk := handle.read(1 << 20):
                    progress.update(task, advance=len(chunk))
                    yield chunk

        try:
            with client(server, token) as api, Progress(console=console, transient=True) as progress:
                task = progress.add_task(f"uploading {file.name}", total=size)
                uploaded = api.request("PUT", f"/models/{model}/file", content=chunks(progress, task))
        except FleetserveError as err:
            raise fail(err) from None
        data = UploadedFile.model_validate(uploaded)
        console.print(f"model/{model}: {data.size} bytes, sha256 {data.sha256}", markup=False)

    from fleetserve.cli import credentials, rollout  # they read this module's options

    rollout.register(app)
    credentials.register(app)


def parse_duration(text: str) -> float:
    """``30s``, ``15m``, ``24h`` or ``7d`` (or plain seconds) as seconds; ValueError otherwise."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "s")
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise ValueError(f"{text!r} is not a duration: write e.g. 30m, 24h or 7d") from None
    if not value > 0:
        raise ValueError(f"{text!r}: a duration must be positive")
    return value
