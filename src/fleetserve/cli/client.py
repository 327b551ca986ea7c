"""How the CLI reaches the control plane: address and admin token from flags, environment or a
config file, and an HTTP client that turns error answers into readable messages.

Precedence: ``--server``/``--token`` flags, then ``FLEETSERVE_SERVER``/``FLEETSERVE_TOKEN``, then
``FLEETSERVE_TOKEN_FILE`` (a file holding the admin token, or a tokens file with an ``admin`` key),
then the config file (``$FLEETSERVE_CONFIG``, default ``~/.config/fleetserve/config.yaml``) with
keys ``server`` and ``token``. No command needs a token on its command line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from fleetserve.errors import FleetserveError
from fleetserve.secretfile import read_secret, write_secret

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


def write_config(server: str, token: str) -> Path:
    """Save server and token for later commands (mode 0600 from creation: the token is a secret)."""
    return write_secret(config_path(), yaml.safe_dump({"server": server, "token": token}))


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


@dataclass(frozen=True)
class Target:
    """The control plane to talk to, and the admin token to show it."""

    server: str
    token: str | None


def resolve(server: str | None, token: str | None) -> Target:
    """Flags win over the environment, which wins over the config file."""
    config = read_config()
    return Target(
        server=(
            server or os.environ.get("FLEETSERVE_SERVER") or config.get("server") or DEFAULT_SERVER
        ).rstrip("/"),
        token=token
        or os.environ.get("FLEETSERVE_TOKEN")
        or (
            token_from_file(Path(os.environ["FLEETSERVE_TOKEN_FILE"]))
            if os.environ.get("FLEETSERVE_TOKEN_FILE")
            else None
        )
        or config.get("token"),
    )


class ApiClient:
    """A thin client of the admin API; every failure becomes a ClientError with the server's words."""

    def __init__(self, target: Target, transport: httpx.BaseTransport | None = None, timeout: float = 30.0):
        headers = {"Authorization": f"Bearer {target.token}"} if target.token else {}
        self.target = target
        self._http = httpx.Client(
            base_url=target.server, headers=headers, timeout=timeout, transport=transport
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
