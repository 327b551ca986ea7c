"""``fleetserve agent``: discover this machine, enrol or register it, run the replicas assigned to it."""

from __future__ import annotations

import logging
import os
import signal
import ssl
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fleetserve.agent.access import SourcePolicy
from fleetserve.agent.cache import HubAccess, ModelCache
from fleetserve.agent.client import AgentClient
from fleetserve.agent.credential import CredentialFile
from fleetserve.agent.describe import make_describe
from fleetserve.agent.exporter_relay import ExporterRelay
from fleetserve.agent.fingerprint import EngineProbe
from fleetserve.agent.gpustats import make_reader, own_readers
from fleetserve.agent.runtime import Agent, AgentSettings
from fleetserve.agent.supervisor import Supervisor
from fleetserve.drivers import RuntimeVariant
from fleetserve.engines.binaries import parse_overrides
from fleetserve.engines.spec import EngineKind
from fleetserve.errors import ConfigError, Problem
from fleetserve.inventory.matching import FabricMap
from fleetserve.secretfile import read_secret
from fleetserve.tls import CaUnavailable, ServerTrust, client_verify

log = logging.getLogger("fleetserve.agent")


def parse_labels(items: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` items as labels; a malformed one is a ConfigError naming it."""
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError([Problem("--label", item, "write KEY=VALUE, e.g. --label rack=r7")])
        labels[key] = value
    return labels


def join_token(token_file: Path | None, argv_token: str | None) -> str | None:
    """The join token from ``--token-file`` (the token alone, or a tokens file with a ``join`` key),
    else ``$FLEETSERVE_JOIN_TOKEN``, else the discouraged ``--token``; None: the agent has only its
    stored credential."""
    if token_file is not None:
        try:
            text = read_secret(token_file)
        except OSError as exc:
            raise ConfigError([Problem("--token-file", str(token_file), f"cannot read it: {exc}")]) from exc
        try:
            data: Any = yaml.safe_load(text)
        except yaml.YAMLError:
            data = None
        if isinstance(data, dict):
            if not isinstance(data.get("join"), str):
                raise ConfigError(
                    [Problem("--token-file", str(token_file), "a tokens file needs a 'join' key")]
                )
            return str(data["join"])
        return text
    from_env = os.environ.get("FLEETSERVE_JOIN_TOKEN")
    if from_env:
        return from_env
    if argv_token:
        print(
            "fleetserve agent: warning: a join token on the command line is visible to every user "
            "of this machine (ps); use --token-file or FLEETSERVE_JOIN_TOKEN",
            file=sys.stderr,
        )
    return argv_token or None


def load_fabric_map(path: Path | None) -> FabricMap:
    """The fabric map file (YAML: portGuids / subnetPrefixes → fabric), or an empty map."""
    if path is None:
        return FabricMap()
    try:
        raw: Any = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError([Problem(str(path), "", f"cannot read the fabric map: {exc}")]) from exc
    if not isinstance(raw, dict):
        raise ConfigError(
            [Problem(str(path), "", "a fabric map is a mapping with portGuids and/or subnetPrefixes")]
        )
    return FabricMap.from_dict(raw, location=str(path))


@dataclass(frozen=True)
class SourceSettings:
    """Where the agent may read models from, and how it reaches the Hugging Face Hub."""

    model_dirs: tuple[Path, ...] = ()
    allow_private: bool = False
    hf_mirror: Path | None = None
    hf_token_file: Path | None = None
    llama_server: Path | None = None

    def mirror(self) -> Path | None:
        """The offline mirror: --hf-mirror, or the default Hugging Face cache under HF_HUB_OFFLINE."""
        if self.hf_mirror is not None:
            return self.hf_mirror
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE) if constants.is_offline_mode() else None


def server_verify(
    server: str, trust: ServerTrust, stop: threading.Event, interval: float
) -> ssl.SSLContext | bool | None:
    """How the agent verifies the control plane (``fleetserve.tls.client_verify``), retrying while
    the server cannot be reached; a refused plain address or a wrong pin ends the agent at once.
    None if stopped first."""
    while not stop.is_set():
        try:
            return client_verify(server, trust)
        except CaUnavailable as exc:
            log.warning("%s; retrying", exc)
            stop.wait(interval)
    return None


def run_agent(
    server: str,
    token: str | None,
    credential_file: Path,
    name: str,
    labels: dict[str, str],
    address: str,
    engine_host: str,
    cache_dir: Path,
    cache_max: int | None,
    inventory_file: Path | None,
    fabric_map: Path | None,
    engine_binaries: list[str],
    interval: float,
    log_dir: Path,
    state_dir: Path,
    root: Path,
    log_level: str,
    trust: ServerTrust | None = None,
    sources: SourceSettings | None = None,
    gpu_exporter: str | None = None,
) -> None:
    """Run the agent until SIGTERM or SIGINT; then stop every engine it started."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # One line per heartbeat and health probe would drown what matters.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    stop = threading.Event()

    def _stop(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    # Stops what a previous run of this agent left (recorded in state_dir) first: before anything
    # starts, and whether or not the control plane answers yet.
    supervisor = Supervisor(log_dir, state_dir=state_dir)
    for leftover in supervisor.leftovers:
        logging.getLogger("fleetserve.agent").warning("stopped what a previous run left: %s", leftover)
    verify = server_verify(server, trust or ServerTrust(), stop, interval)
    if verify is None:
        supervisor.shutdown()
        return
    sources = sources or SourceSettings()
    binaries = parse_overrides(engine_binaries)
    if sources.llama_server is not None:
        binaries.setdefault((EngineKind.LLAMACPP, RuntimeVariant.CPU), str(sources.llama_server))
    settings = AgentSettings(engine_host=engine_host, interval=interval, binaries=binaries)
    describe = make_describe(name, labels, address, load_fabric_map(fabric_map), inventory_file, root)
    # A report times out after two intervals (at least 2 s, at most the client's default 10 s).
    client = AgentClient(
        server,
        token,
        CredentialFile(credential_file),
        verify=verify,
        report_timeout=min(10.0, max(2.0, 2 * interval)),
    )
    cache = ModelCache(
        cache_dir,
        max_bytes=cache_max,
        control_plane=(server, client.token),
        control_plane_verify=verify,
        hf_mirror=sources.mirror(),
        hub_access=HubAccess.from_environment(sources.hf_token_file),
        policy=SourcePolicy.strict(sources.model_dirs, sources.allow_private),
    )
    engines = EngineProbe(binaries)
    gpu_reader = make_reader(root)
    if gpu_exporter is not None:
        # The exporter is fetched on a thread of its own; the report takes its latest reading.
        relay = ExporterRelay(gpu_exporter, own_readers(root), interval=interval)
        threading.Thread(target=relay.run, args=(stop,), name="gpu-exporter", daemon=True).start()
        gpu_reader = relay.read
    agent = Agent(
        client,
        describe,
        supervisor,
        cache,
        settings,
        gpu_reader=gpu_reader,
        engines=engines.fingerprints,
    )
    try:
        agent.run(stop)
    finally:
        client.close()
