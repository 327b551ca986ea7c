"""How the CLI reaches the control plane: address and admin token from flags, environment or a
config file, and an HTTP client that turns error answers into readable messages.

Precedence: ``--server``/``--token`` flags, then ``FLEETSERVE_SERVER``/``FLEETSERVE_TOKEN``, then
``FLEETSERVE_TOKEN_FILE`` (a file holding the admin token, or a tokens file with an ``admin`` key),
then the config file (``$FLEETSERVE_CONFIG``, default ``~/.config/fleetserve/config.yaml``) with
keys ``server`` and ``token``. No command needs a token on its command line.

How the server is verified (``fleetserve.tls.ServerTrust``): ``FLEETSERVE_CA_HASH`` (the pin the
server printed), ``FLEETSERVE_CA_FILE`` and ``FLEETSERVE_INSECURE=1`` when any is set, else the
config file's ``ca_hash``, ``ca_file`` and ``insecure`` (saved by ``fleetserve login``) for the
config file's server. Plain HTTP to a non-loopback server is refused unless insecure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from fleetserve.errors import FleetserveError
from fleetserve.secretfile import read_secret, write_secret
from fleetserve.tls import ServerTrust, client_verify

DEFAULT_SERVER = "http://127.0.0.1:8080"
API = "/api/v1"


class ClientError(FleetserveError):
    """The control plane could not be reached, or answered with an error."""

    def __init__(self, message: str, status: int | None = None, problems: list[dict[str, str]] | None = None):
        super().__init__(message)
        self.status = status
        self.problems = problems or []


def config_path() -> Path:
    """Where the CLI's config file lives."""
    env = os.environ.get("FLEETSERVE_CONFIG")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "fleetserve" / "config.yaml"


def read_config() -> dict[str, str]:
    """The config file's settings; an absent file is empty, a broken one is an error."""
    path = config_path()
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, yaml.YAMLError) as exc:
        raise ClientError(f"cannot read config file {path}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ClientError(f"config file {path} must be a mapping with keys server and token")
    return {str(k): str(v) for k, v in data.items()}


def write_config(server: str, token: str, trust: ServerTrust | None = None) -> Path:
    """Save server, token and how to verify the server for later commands (mode 0600 from
    creation, written atomically: the token is a secret)."""
    data: dict[str, object] = {"server": server, "token": token}
    if trust is not None:
        if trust.ca_hash is not None:
            data["ca_hash"] = str(trust.ca_hash)
        if trust.ca_file is not None:
            data["ca_file"] = str(trust.ca_file.absolute())
        if trust.insecure:
            data["insecure"] = True
    return write_secret(config_path(), yaml.safe_dump(data))


def token_from_file(path: Path, key: str = "admin") -> str:
    """A token from a file: the token alone, or a tokens file (``fleetserve server --token-file``)
    with ``key``."""
    try:
        text = read_secret(path)
    except OSError as exc:
        raise ClientError(f"cannot read the token file {path}: {exc}") from exc
    try:
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    if isinstance(data, dict):
        if not isinstance(data.get(key), str):
            raise ClientError(f"the tokens file {path} has no {key!r} key")
        return str(data[key])
    return text


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")


def trust_from(config: dict[str, str], server: str) -> ServerTrust:
    """How to verify ``server``: the environment's settings if any is set, else the config file's
    when ``server`` is the config file's server."""
    env = {k: os.environ.get(f"FLEETSERVE_{k.upper()}") for k in ("ca_hash", "ca_file", "insecure")}
    if any(env.values()):
        source = env
    elif config.get("server", "").rstrip("/") == server:
        source = {k: config.get(k) for k in env}
    else:
        return ServerTrust()
    return ServerTrust.of(source["ca_file"], source["ca_hash"], _truthy(source["insecure"]))


@dataclass(frozen=True)
class Target:
    """The control plane to talk to, the admin token to show it, and how to verify it."""

    server: str
    token: str | None
    trust: ServerTrust = field(default_factory=ServerTrust)


def resolve(server: str | None, token: str | None) -> Target:
    """Flags win over the environment, which wins over the config file."""
    config = read_config()
    url = (server or os.environ.get("FLEETSERVE_SERVER") or config.get("server") or DEFAULT_SERVER).rstrip(
        "/"
    )
    return Target(
        server=url,
        token=token
        or os.environ.get("FLEETSERVE_TOKEN")
        or (
            token_from_file(Path(os.environ["FLEETSERVE_TOKEN_FILE"]))
            if os.environ.get("FLEETSERVE_TOKEN_FILE")
            else None
        )
        or config.get("token"),
        trust=trust_from(config, url),
    )


class ApiClient:
    """A thin client of the admin API; every failure becomes a ClientError with the server's words.
    The server is verified as ``target.trust`` says (a TlsError before any request otherwise)."""

    def __init__(self, target: Target, transport: httpx.BaseTransport | None = None, timeout: float = 30.0):
        headers = {"Authorization": f"Bearer {target.token}"} if target.token else {}
        self.target = target
        verify = client_verify(target.server, target.trust) if transport is None else True
        self._http = httpx.Client(
            base_url=target.server, headers=headers, timeout=timeout, transport=transport, verify=verify
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(
        self,
        method: str,
        path: str,
        json: Any = None,
        params: dict[str, Any] | None = None,
        content: Any = None,
    ) -> Any:
        """Send one request to ``/api/v1{path}``; return the decoded JSON body."""
        try:
            response = self._http.request(method, API + path, json=json, params=params, content=content)
        except httpx.HTTPError as exc:
            if "CERTIFICATE_VERIFY_FAILED" in str(exc):
                raise ClientError(
                    f"the fleetserve server at {self.target.server} could not be verified: {exc}. "
                    "Give the CA pin the server printed (FLEETSERVE_CA_HASH=sha256:..., or "
                    "`fleetserve login --ca-hash`) or its CA file (FLEETSERVE_CA_FILE)."
                ) from exc
            raise ClientError(
                f"cannot reach the fleetserve server at {self.target.server}: {exc}. "
                "Is `fleetserve server` running? Set --server or FLEETSERVE_SERVER."
            ) from exc
        if response.status_code >= 400:
            try:
                error = response.json().get("error", {})
            except ValueError:
                error = {}
            message = error.get("message") or response.text or response.reason_phrase
            if response.status_code == 401:
                message += " (give the admin token with --token, FLEETSERVE_TOKEN or `fleetserve login`)"
            raise ClientError(message, response.status_code, error.get("problems") or [])
        return response.json() if response.content else None
