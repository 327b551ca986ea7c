"""``fleetserve kube``: render, compose, apply and import through Kubernetes instead of node agents."""

from __future__ import annotations

import json
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from fleetserve.cli.output import Format, fail
from fleetserve.errors import ConfigError, FleetserveError, Problem
from fleetserve.kube.cluster import ClusterRender, pick_cluster, render_cluster
from fleetserve.kube.objects import dump_yaml, load_yaml_objects, plain
from fleetserve.kube.stack import COMPONENTS, StackPlan, components_recorded, compose, stack_configmap
from fleetserve.spec.cluster import Cluster, DeviceApi
from fleetserve.spec.loader import Documents, load_files

kube = typer.Typer(
    help=(
        "Run fleetserve's placement and engines on Kubernetes, without node agents.\n\n"
        "A Cluster document lists the device classes whose pools the cluster has (`cpu` for the CPU "
        "pool); their drivers select the serving stack. `render` prints the objects for the "
        "deployments placed onto the cluster's pools; `stack` the components the cluster needs; "
        "`apply` server-side applies the objects (field manager fleetserve) and never deletes; "
        "`import` reads Nodes and DRA ResourceSlices back as fleetserve Node documents; `exporters` "
        "lists the GPU metrics exporters (DCGM, AMD) the control plane would scrape."
    ),
    no_args_is_help=True,
)

FilesArg = Annotated[
    list[Path],
    typer.Argument(
        help="YAML files with DeviceClass, Fabric, Node, Model, Deployment and Cluster documents.",
        show_default=False,
    ),
]
ClusterOpt = Annotated[
    str | None, typer.Option("--cluster", "-c", help="The Cluster document to use (needed when several).")
]
ExistingOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--existing",
        help="YAML of what the cluster holds now (e.g. `kubectl get deploy,lws,svc,resourceclaimtemplates,cm "
        "-l app.kubernetes.io/managed-by=fleetserve -o yaml`): its replicas stay where they run and its "
        "stack components are kept. Repeatable.",
    ),
]
DeviceApiOpt = Annotated[
    DeviceApi | None,
    typer.Option(
        "--device-api",
        help="dra: a ResourceClaimTemplate per replica (resource.k8s.io/v1); plugin: device-plugin "
        "resources (nvidia.com/gpu, amd.com/gpu, squat.ai/dri). Default: the Cluster's deviceApi.",
    ),
]
KubeconfigOpt = Annotated[
    Path | None,
    typer.Option("--kubeconfig", help="The kubeconfig file (default: $KUBECONFIG or ~/.kube/config)."),
]
ContextOpt = Annotated[str | None, typer.Option("--context", help="The kubeconfig context to use.")]


class RenderFormat(StrEnum):
    """How ``kube render`` prints its objects."""

    YAML = "yaml"
    JSON = "json"


def _err() -> Console:
    return Console(stderr=True, soft_wrap=True)


def _load(files: Sequence[Path]) -> Documents:
    if not files:
        raise ConfigError(
            [Problem("kube", "files", "give the YAML files that describe the fleet and the cluster")]
        )
    return load_files(files)


def _existing(paths: Sequence[Path] | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    problems = []
    for path in paths or ():
        try:
            out.extend(load_yaml_objects(path.read_text(encoding="utf-8"), str(path)))
        except OSError as exc:
            problems.append(Problem(str(path), "", f"cannot read file: {exc.strerror or exc}"))
        except ValueError as exc:
            problems.append(Problem(str(path), "", str(exc)))
    if problems:
        raise ConfigError(problems)
    return out


def _with_device_api(cluster: Cluster, device_api: DeviceApi | None) -> Cluster:
    return cluster if device_api is None else cluster.model_copy(update={"device_api": device_api})


def print_stack(plan: StackPlan, console: Console) -> None:
    """A stack plan for a person: the condition, then one line per component."""
    cond = plan.condition
    mark = "[green]True[/]" if cond.status else "[red]False[/]"
    console.print(f"cluster {plan.cluster}: claimed drivers {', '.join(plan.claimed) or 'none'}")
    console.print(f"{cond.type}={mark} {cond.reason}: ", end="")
    console.print(cond.message, markup=False)
    for name in plan.components:
        c = COMPONENTS.get(name)
        kept = "  (kept: no claimed driver selects it any more)" if name in plan.kept else ""
        where = f"  namespace {c.namespace}  {c.project}  {c.what}" if c else ""
        console.print(f"  {name}{where}{kept}", markup=False)


def print_summary(result: ClusterRender, console: Console) -> None:
    """What rendering did, for a person (stderr, so stdout stays the manifests)."""
    print_stack(result.stack, console)
    for d in result.decisions:
        if not d.accepted.status:
            console.print(f"deployment {d.deployment}: Accepted=False {d.accepted.reason}: ", end="")
            console.print(d.accepted.message, markup=False)
        for u in d.unplaced:
            console.print(
                f"deployment {d.deployment}: {u.name} unschedulable on this cluster's pools", markup=False
            )
    for name, why in result.kept_as_is.items():
        console.print(f"replica {name}: kept as it runs ({why})", markup=False)
    if result.surplus:
        console.print(
            f"surplus replicas, left running (delete them when you are ready): {', '.join(result.surplus)}",
            markup=False,
        )
    for note in result.notes:
        console.print(f"note: {note}", markup=False)
    console.print(f"{len(result.rendered)} replicas rendered, {len(result.objects)} objects", markup=False)


@kube.command("render")
def render_command(
    files: FilesArg,
    cluster_name: ClusterOpt = None,
    existing: ExistingOpt = None,
    device_api: DeviceApiOpt = None,
    output: Annotated[RenderFormat, typer.Option("--output", "-o", help="yaml or json (a List).")] = (
        RenderFormat.YAML
    ),
) -> None:
    """Print the Kubernetes objects for the deployments placed onto a cluster's pools.

    Per replica: a ResourceClaimTemplate (or device-plugin resources), a Deployment (a
    LeaderWorkerSet for multi-node vLLM) and the Service the gateway routes to. A summary of the
    stack and placement goes to stderr. Exit status 2: the input is invalid.
    """
    try:
        docs = _load(files)
        cluster = _with_device_api(pick_cluster(docs, cluster_name), device_api)
        result = render_cluster(docs, cluster, _existing(existing), base_dir=files[0].parent)
    except FleetserveError as err:
        raise fail(err) from None
    print_summary(result, _err())
    if output is RenderFormat.JSON:
        typer.echo(json.dumps({"apiVersion": "v1", "kind": "List", "items": result.objects}, indent=2))
    else:
        typer.echo(dump_yaml(result.objects), nl=False)


@kube.command("stack")
def stack_command(
    cluster_name: Annotated[str, typer.Argument(metavar="CLUSTER", help="The Cluster document's name.")],
    files: FilesArg,
    existing: ExistingOpt = None,
    output: Annotated[
        Format, typer.Option("--output", "-o", help="table for people; yaml/json: the stack ConfigMap.")
    ] = Format.TABLE,
) -> None:
    """The serving stack a cluster needs, composed from the drivers its classes claim.

    A class claiming a driver no component provides sets StackReady=False, reason
    UnsupportedDevices, and every component that already exists (--existing) is kept.
    """
    try:
        docs = _load(files)
        cluster = pick_cluster(docs, cluster_name)
        recorded: list[str] = []
        for obj in _existing(existing):
            if obj.get("kind") == "ConfigMap":
                recorded += components_recorded(obj)
        plan = compose(cluster, {c.name: c for c in docs.classes}, recorded)
    except FleetserveError as err:
        raise fail(err) from None
    console = Console(soft_wrap=True)
    if output is Format.TABLE:
        print_stack(plan, console)
    elif output is Format.JSON:
        typer.echo(json.dumps(plain(stack_configmap(plan)), indent=2))
    else:
        typer.echo(dump_yaml([plain(stack_configmap(plan))]), nl=False)


@kube.command("apply")
def apply_command(
    files: FilesArg,
    cluster_name: ClusterOpt = None,
    device_api: DeviceApiOpt = None,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Ask the server to validate only (dryRun=All).")
    ] = False,
    force_conflicts: Annotated[
        bool, typer.Option("--force-conflicts", help="Take over fields another field manager owns.")
    ] = False,
) -> None:
    """Render a cluster against what it holds now and server-side apply the objects.

    Reads the objects fleetserve made before (its replicas stay where they run, its stack
    components are kept), renders, then applies every object with field manager fleetserve.
    Nothing is deleted: surplus replicas are listed for you to remove.
    """
    from fleetserve.kube.apply import Applied, api_client, apply_objects, read_existing

    err_console = _err()
    try:
        docs = _load(files)
        cluster = _with_device_api(pick_cluster(docs, cluster_name), device_api)
        api = api_client(kubeconfig, context)
        existing = read_existing(api, cluster.name, cluster.namespace)
        result = render_cluster(docs, cluster, existing, base_dir=files[0].parent)
        print_summary(result, err_console)

        def show(a: Applied) -> None:
            where = f"{a.namespace}/" if a.namespace else ""
            err_console.print(f"{a.kind.lower()}/{where}{a.name} {a.result}", markup=False)

        apply_objects(api, result.applied, dry_run=dry_run, force_conflicts=force_conflicts, on_applied=show)
    except FleetserveError as err:
        raise fail(err) from None


@kube.command("import")
def import_command(
    files: Annotated[
        list[Path] | None,
        typer.Argument(
            help="YAML with the DeviceClass documents devices are matched against.", show_default=False
        ),
    ] = None,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Write the Node documents here, not stdout.")
    ] = None,
) -> None:
    """Read a cluster's Nodes and DRA ResourceSlices as fleetserve Node documents.

    Each GPU a ResourceSlice publishes is matched to a device class by its productName (and
    vendor); a device no class recognises is listed in a comment, never dropped silently.
    """
    from fleetserve.kube.apply import api_client
    from fleetserve.kube.importer import dump_nodes, nodes_from_cluster, read_cluster_inventory

    try:
        docs = load_files(files) if files else Documents()
        api = api_client(kubeconfig, context)
        nodes, slices = read_cluster_inventory(api)
        result = nodes_from_cluster(nodes, slices, {c.name: c for c in docs.classes})
    except FleetserveError as err:
        raise fail(err) from None
    text = dump_nodes(result)
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text, encoding="utf-8")
    err_console = _err()
    err_console.print(f"{len(result.nodes)} nodes imported", markup=False)
    for line in result.unmatched:
        err_console.print(f"  unmatched: {line}", markup=False)


@kube.command("exporters")
def exporters_command(
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    output: Annotated[Format, typer.Option("--output", "-o", help="table, json or yaml.")] = Format.TABLE,
) -> None:
    """The GPU metrics exporters the cluster runs, as `fleetserve server --kube-exporters` finds them.

    NVIDIA's DCGM exporter and AMD's device-metrics-exporter are found by their pods' labels and
    named container port (the driver table's rows); each row is the driver, the pod, the node
    whose GPUs it reports and the URL scraped. Exporter pods that cannot be scraped (not Running,
    no IP, no such port) are listed on stderr.
    """
    from fleetserve.cli.output import emit
    from fleetserve.kube.apply import api_client
    from fleetserve.kube.exporters import discover_exporters

    try:
        found = discover_exporters(api_client(kubeconfig, context))
    except FleetserveError as err:
        raise fail(err) from None
    rows = [{"driver": t.driver.value, "pod": t.pod, "node": t.node, "url": t.url} for t in found.targets]
    columns = [(name, lambda row, name=name: row[name]) for name in ("driver", "pod", "node", "url")]
    emit(rows, output, Console(soft_wrap=True), columns)
    err_console = _err()
    err_console.print(f"{len(found.targets)} GPU metrics exporters found", markup=False)
    for line in found.skipped:
        err_console.print(f"  skipped: {line}", markup=False)
