"""The ``fleetserve`` console script: one typer app, its commands registered here in the order
``--help`` lists them, each defined in the module of its group:

- ``plan`` and ``dev tiny-model``: here;
- ``server``, ``gateway`` and ``up``: ``cli.serve``; ``agent``: ``cli.agent`` (the flags they
  share: ``cli.options``);
- the admin commands (``login``, ``apply``, ``get``, ...): ``cli.admin``; ``usage`` and
  ``events``: ``cli.records``; the ``kube`` group: ``cli.kube``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from fleetserve import __version__
from fleetserve.cli import admin, agent, records, serve
from fleetserve.cli.kube import kube
from fleetserve.cli.output import fail
from fleetserve.cli.plan import Output, run_plan
from fleetserve.engines.spec import Task
from fleetserve.errors import ConfigError, FleetserveError
from fleetserve.spec.resources import ModelFormat

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


dev = typer.Typer(help="Developer tools.", no_args_is_help=True)


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
    task: Annotated[
        Task,
        typer.Option(
            "--task",
            help="What a deployment of it serves: generate; embed (a GGUF declaring mean pooling); "
            "rerank (a GGUF declaring rank pooling, or a one-label classifier in safetensors).",
        ),
    ] = Task.GENERATE,
    size: Annotated[
        str,
        typer.Option(
            "--size",
            help="A named GGUF size: tiny (2 layers, 64 wide, 256 tokens of context) or prefill-1s "
            "(8 layers, 256 wide, 4,096 of context: about a second to prefill 2,000 tokens on one "
            "CPU core, llama-server --threads 1).",
        ),
    ] = "tiny",
    layers: Annotated[
        int | None, typer.Option("--layers", min=1, max=256, help="Layers, replacing the size's.")
    ] = None,
    width: Annotated[
        int | None,
        typer.Option(
            "--width",
            min=4,
            max=16384,
            help="Width (a multiple of 4, the heads), replacing the size's; the feed-forward is twice it.",
        ),
    ] = None,
    context: Annotated[
        int | None,
        typer.Option("--context", min=16, max=1 << 20, help="Tokens of context, replacing the size's."),
    ] = None,
) -> None:
    """Write a tiny llama-architecture model that tests and the quickstart serve: a GGUF (about
    0.8 MB at the tiny size) or a safetensors directory (about 0.7 MB; the tiny size only). Never
    downloaded; it speaks gibberish."""
    from fleetserve.cli.local import tiny_model
    from fleetserve.dev.tinymodel import shape_for

    try:
        shape = shape_for(size, layers=layers, width=width, context=context)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--size/--layers/--width/--context") from None
    if shape != shape_for() and (fmt is not ModelFormat.GGUF or task is not Task.GENERATE):
        raise typer.BadParameter(
            "a size other than tiny is written for --format gguf --task generate only", param_hint="--size"
        )
    try:
        tiny_model(out, Console(), fmt, task, shape)
    except FleetserveError as err:
        raise fail(err) from None


# The commands in the order ``--help`` lists them (the groups after).
app.command("server")(serve.server_command)
admin.register(app)
records.register(app)
app.command("agent")(agent.agent_command)
app.command("up")(serve.up_command)
app.command("gateway")(serve.gateway_command)
app.add_typer(dev, name="dev")
app.add_typer(kube, name="kube")
