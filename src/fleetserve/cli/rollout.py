"""The rollout commands: follow a deployment's rolling update (``rollout status``) or undo the last
change of a deployment or of a model (``rollout undo [deployment/|model/]NAME``), reading the admin
API's answers as ``adminapi``'s models."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.console import Console

from fleetserve.adminapi.fleet import DeploymentDetail, UndoneDeployment, UndoneModel
from fleetserve.cli import views
from fleetserve.cli.admin import ServerOpt, TokenOpt, call_as


def register(app: typer.Typer) -> None:
    """Add ``rollout status`` and ``rollout undo`` to ``app``."""
    rollout = typer.Typer(
        help="Rolling updates of a deployment (a change of it, or of its model's weights): follow one, "
        "or undo the last change of a deployment or a model.",
        no_args_is_help=True,
    )
    app.add_typer(rollout, name="rollout")

    @rollout.command("status")
    def rollout_status(
        deployment: Annotated[str, typer.Argument(help="The deployment's name.")],
        timeout: Annotated[
            float, typer.Option(help="Give up (exit 1) after this many seconds.", min=0)
        ] = 600.0,
        watch: Annotated[bool, typer.Option(help="Wait until the rollout completes.")] = True,
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Print a deployment's rollout progress and its cause (the deployment changed, or the
        weights of its model); wait until every replica runs its current revision."""
        console = Console(soft_wrap=True)
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            data = call_as(DeploymentDetail, server, token, "GET", f"/deployments/{deployment}")
            line, done = views.rollout_line(data)
            if line != last:
                console.print(line, markup=False)
                last = line
            if done:
                return
            if not watch or time.monotonic() >= deadline:
                raise typer.Exit(1)
            time.sleep(1.0)

    @rollout.command("undo")
    def rollout_undo(
        target: Annotated[
            str,
            typer.Argument(
                help="NAME or deployment/NAME: a deployment; model/NAME: a model.", metavar="[KIND/]NAME"
            ),
        ],
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Apply a deployment's previous spec again (a rollout back to its previous revision), or a
        model's (model/NAME: every deployment serving it rolls back to its previous weights)."""
        kind, _, name = target.rpartition("/")
        console = Console(soft_wrap=True)
        if kind == "model":
            model = call_as(UndoneModel, server, token, "POST", f"/models/{name}/undo")
            console.print(f"model/{name} rolled back to weights {model.weights_revision}", markup=False)
            return
        if kind not in ("", "deployment"):
            raise typer.BadParameter(f"{kind!r}: give NAME, deployment/NAME or model/NAME")
        data = call_as(UndoneDeployment, server, token, "POST", f"/deployments/{name}/undo")
        console.print(
            f"deployment/{name} rolled back to revision {data.revision} (generation {data.generation})",
            markup=False,
        )
