"""``fleetserve agent``: the node agent's flags, parsed here and handed to ``cli.agent_cmd.run_agent``
(which, with the agent itself, is imported only when the command runs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fleetserve.cli.options import (
    AllowPrivateSourcesOpt,
    HfMirrorOpt,
    HfTokenFileOpt,
    LlamaServerOpt,
    LogLevelOpt,
)
from fleetserve.cli.output import fail
from fleetserve.errors import FleetserveError


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
    gpu_exporter: Annotated[
        str | None,
        typer.Option(
            "--gpu-exporter",
            metavar="URL|auto",
            help="Report the GPU readings of the DCGM or AMD device-metrics exporter at URL (e.g. "
            "http://127.0.0.1:9400/metrics) instead of reading NVML/sysfs; 'auto' probes their default "
            "ports (9400, 5000) on 127.0.0.1. Where none answers, the agent reads the GPUs itself.",
        ),
    ] = None,
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
    loopback, or with --insecure. With --gpu-exporter, the GPU metrics it reports are those of the
    node's DCGM or AMD exporter (falling back to its own reads, said once in the log).
    """
    from fleetserve.agent.describe import node_name
    from fleetserve.agent.exporter_relay import candidates
    from fleetserve.agent.runtime import default_cache_dir
    from fleetserve.cli.agent_cmd import SourceSettings, join_token, parse_labels, run_agent
    from fleetserve.tls import ServerTrust
    from fleetserve.units import parse_bytes

    try:
        if gpu_exporter is not None:
            candidates(gpu_exporter)
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
            gpu_exporter=gpu_exporter,
        )  # fmt: skip
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    except FleetserveError as err:
        raise fail(err) from None
