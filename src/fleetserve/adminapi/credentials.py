"""The admin API's credentials: gateway API keys, admin and join tokens (each shown once, when
created), and node enrolments."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from fleetserve.adminapi.values import IsoTime, View
from fleetserve.inventory.approval import Hardware
from fleetserve.store.credentials import TokenKind


class KeyRequest(BaseModel):
    """A new gateway API key: its name, the models it may use ("*" for all), its rate limits."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    models: list[
        Annotated[str, Field(min_length=1, max_length=63, pattern=r"^(\*|[a-z0-9]([a-z0-9.-]*[a-z0-9])?)$")]
    ] = Field(min_length=1, max_length=1000)
    rpm: int | None = Field(default=None, ge=1, le=10_000_000, description="Requests per minute.")
    tpm: int | None = Field(default=None, ge=1, le=10_000_000_000, description="Tokens per minute.")


class KeyView(View):
    """A gateway API key without its secret."""

    id: int
    name: str
    models: list[str]
    rpm: int | None
    tpm: int | None
    created_at: IsoTime
    revoked: bool


class CreatedKey(KeyView):
    """A new gateway API key with its secret, shown this once (only its hash is stored)."""

    key: str


class TokenRequest(BaseModel):
    """A new admin or join token, optionally refused after ``expiresIn`` seconds."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    kind: TokenKind
    expires_in: float | None = Field(
        default=None, gt=0, le=10 * 365 * 24 * 3600, alias="expiresIn", description="Seconds from now."
    )


class TokenView(View):
    """An admin or join token without its secret; ``valid``: neither revoked nor expired now."""

    id: int
    kind: TokenKind
    created_at: IsoTime
    expires_at: IsoTime | None
    revoked: bool
    valid: bool


class CreatedToken(TokenView):
    """A new admin or join token with its secret, shown this once (only its hash is stored)."""

    token: str


class EnrolmentView(View):
    """A node name's identity: enrolled (a credential issued), approved, or waiting (requested);
    the hardware approved, and a registration's claim beyond it that waits (since ``held_at``)."""

    node: str
    enrolled: bool
    issued_at: IsoTime | None
    approved: bool
    requested_at: IsoTime | None
    requested_from: str | None
    approved_hardware: Hardware | None = None
    claimed_hardware: Hardware | None = None
    held_at: IsoTime | None = None


class ApprovalView(EnrolmentView):
    """An approval: the identity after it, and the hardware claim it applied (None: it let the
    next enrolment through instead)."""

    applied_hardware: Hardware | None = None
