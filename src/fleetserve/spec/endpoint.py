"""The ``Endpoint`` kind: an OpenAI-compatible server fleetserve did not start (an Ollama box, a vLLM
someone already runs, a hosted API), routed, limited and accounted like a replica, never placed.

An Endpoint names its ``url`` (the server's root: fleetserve sends the client's path, ``/v1/...``
included, under it), the models it serves (``models``: names, or ``{fleetserve name: upstream
name}`` where the upstream calls a model otherwise), the file its API key is read from
(``keyFile``: a file name inside the control plane's ``--endpoint-keys`` directory, never the key
itself), its capacity ``weight`` beside replicas, the path its health is checked on
(``healthPath``) and whose route table it is relayed by (``engine``: vLLM's, the OpenAI API as
most servers copy it, or llama.cpp's for a llama-server). A Deployment lists it in ``endpoints``
beside its profiles; a model no deployment serves is served by the Endpoints that list it alone.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from fleetserve.engines.spec import EngineKind
from fleetserve.spec.base import Name, Spec

MAX_URL = 2048
MAX_MODELS = 256
MAX_WEIGHT = 1000.0
DEFAULT_HEALTH_PATH = "/v1/models"
# A model's name as the upstream knows it: printable, no spaces or quotes (it goes into JSON and logs).
_UPSTREAM_NAME = re.compile(r"^[A-Za-z0-9._:/@+-]{1,256}$")
# A key file's name inside the --endpoint-keys directory: no path, no hidden file.
_KEY_FILE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")
_PATH = re.compile(r"^/[A-Za-z0-9._~/-]{0,511}$")


class EndpointState(StrEnum):
    """Whether the control plane's last health check of an Endpoint passed."""

    UNKNOWN = "Unknown"  # not checked yet
    READY = "Ready"
    NOT_READY = "NotReady"


class ServedModel(Spec):
    """One model an Endpoint serves: the name clients send, and the upstream's name for it."""

    name: Name
    upstream: str

    @field_validator("upstream")
    @classmethod
    def _upstream_name(cls, v: str) -> str:
        if not _UPSTREAM_NAME.match(v):
            raise ValueError(
                f"{v!r} is not a model name fleetserve sends: use 1-256 letters, digits or ._:/@+-"
            )
        return v


def _models(value: Any) -> Any:
    """``[a, b]`` and ``{a: upstream-a}`` as ServedModel values; anything else as it came."""
    if isinstance(value, dict):
        return [{"name": k, "upstream": v} for k, v in value.items()]
    if isinstance(value, list | tuple):
        return [{"name": v, "upstream": v} if isinstance(v, str) else v for v in value]
    return value


class Endpoint(Spec):
    """An OpenAI-compatible server fleetserve did not start, served beside (or instead of) replicas."""

    kind: Literal["Endpoint"] = "Endpoint"
    name: Name
    url: str = Field(max_length=MAX_URL)
    models: tuple[ServedModel, ...] = Field(min_length=1, max_length=MAX_MODELS)
    key_file: str | None = None
    weight: float = Field(default=1.0, gt=0, le=MAX_WEIGHT)
    health_path: str = DEFAULT_HEALTH_PATH
    engine: EngineKind = EngineKind.VLLM

    @model_validator(mode="before")
    @classmethod
    def _model_forms(cls, data: Any) -> Any:
        if isinstance(data, dict) and "models" in data:
            data = {**data, "models": _models(data["models"])}
        return data

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"{v!r}: use an http:// or https:// URL of the server's root")
        if not parts.hostname or not v.isascii() or any(c in v for c in " \t\r\n\\"):
            raise ValueError(
                f"{v!r}: the URL needs a host, in ASCII (a punycode name), and no spaces or backslashes"
            )
        if parts.username is not None or parts.password is not None:
            raise ValueError("the URL must not carry credentials: put the API key in keyFile")
        if parts.query or parts.fragment or "?" in v or "#" in v:
            raise ValueError(f"{v!r}: no query string or fragment; the URL is the server's root")
        try:
            parts.port  # noqa: B018 - raises on a port out of range
        except ValueError:
            raise ValueError(f"{v!r}: the port must be a number from 1 to 65535") from None
        path = parts.path.rstrip("/")
        if path.endswith("/v1"):
            raise ValueError(
                f"{v!r}: give the server's root without /v1 (the gateway sends the client's path, "
                f"/v1/chat/completions included, under it): {v.rstrip('/')[: -len('/v1')]}"
            )
        if path and not _PATH.match(path):
            raise ValueError(f"{v!r}: the path may hold letters, digits and ._~/- only")
        return v.rstrip("/")

    @field_validator("key_file")
    @classmethod
    def _check_key_file(cls, v: str | None) -> str | None:
        if v is not None and not _KEY_FILE.match(v):
            raise ValueError(
                f"{v!r}: name a file inside the control plane's --endpoint-keys directory (letters, "
                "digits, '.', '_', '-'; no path, not starting with '.'), not a path or the key itself"
            )
        return v

    @field_validator("health_path")
    @classmethod
    def _check_health_path(cls, v: str) -> str:
        if not _PATH.match(v):
            raise ValueError(f"{v!r}: a path starting with '/' of letters, digits and ._~/- only")
        return v

    @model_validator(mode="after")
    def _unique_models(self) -> Endpoint:
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"models: each name once; repeated: {dupes}")
        return self

    def upstream_name(self, model: str) -> str | None:
        """What the upstream calls fleetserve's ``model``; None when it does not serve it."""
        return next((m.upstream for m in self.models if m.name == model), None)


ENDPOINT_PREFIX = "endpoint/"
"""What an Endpoint is called where replicas are (picks, metrics, logs): ``endpoint/NAME``, which no
replica's name can be (a name holds no '/')."""


def upstream_id(name: str) -> str:
    """The name an Endpoint goes by beside replicas: ``endpoint/NAME``."""
    return ENDPOINT_PREFIX + name
