"""The credential commands, which read the admin API's answers as ``adminapi``'s models: ``keys``
(gateway API keys), ``tokens`` (admin and join tokens) and ``nodes`` (enrolments waiting for an
approval)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from fleetserve.adminapi.credentials import (
    ApprovalView,
    CreatedKey,
    CreatedToken,
    EnrolmentView,
    KeyView,
    TokenView,
)
from fleetserve.cli.admin import FormatOpt, ServerOpt, TokenOpt, call, call_all, call_as, parse_duration
from fleetserve.cli.output import Column, Format, emit


def register(app: typer.Typer) -> None:
    """Add ``keys``, ``tokens`` and ``nodes`` to ``app``."""

    keys = typer.Typer(help="Gateway API keys: create (shown once), list, revoke.", no_args_is_help=True)
    app.add_typer(keys, name="keys")

    @keys.command("create")
    def keys_create(
        name: Annotated[str, typer.Argument(help="A name for the key (who or what uses it).")],
        models: Annotated[str, typer.Option(help="Comma-separated models it may use; * for all.")] = "*",
        rpm: Annotated[
            int | None, typer.Option(help="Requests per minute (default: unlimited).", min=1)
        ] = None,
        tpm: Annotated[
            int | None, typer.Option(help="Tokens per minute (default: unlimited).", min=1)
        ] = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
        output: FormatOpt = Format.TABLE,
    ) -> None:
        """Create an API key for the OpenAI-compatible gateway; the key is shown this once."""
        console = Console(soft_wrap=True)
        body = {
            "name": name,
            "models": [m.strip() for m in models.split(",") if m.strip()],
            "rpm": rpm,
            "tpm": tpm,
        }
        data = call_as(CreatedKey, server, token, "POST", "/keys", json=body)
        if output is Format.TABLE:
            console.print(f"key {data.id} ({data.name}): {data.key}", markup=False, highlight=False)
            console.print("shown once; only its hash is stored.", markup=False)
        else:
            emit(data, output, console)

    @keys.command("list")
    def keys_list(server: ServerOpt = None, token: TokenOpt = None, output: FormatOpt = Format.TABLE) -> None:
        """List API keys (no secrets)."""
        console = Console(soft_wrap=True)
        data = call_all(KeyView, server, token, "GET", "/keys")
        columns: tuple[Column, ...] = (
            ("id", lambda k: k.id), ("name", lambda k: k.name), ("models", lambda k: k.models),
            ("rpm", lambda k: k.rpm), ("tpm", lambda k: k.tpm), ("revoked", lambda k: k.revoked),
        )  # fmt: skip
        emit(data, output, console, columns)

    @keys.command("revoke")
    def keys_revoke(
        key_id: Annotated[int, typer.Argument(help="The key's id (see `fleetserve keys list`).")],
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Revoke an API key: the server's gateway refuses it at once (401), separate gateway
        processes within 5 seconds (they cache key lookups that long)."""
        call(server, token, "DELETE", f"/keys/{key_id}")
        Console().print(f"key {key_id} revoked")

    tokens = typer.Typer(
        help="Admin and join tokens: create (shown once), list, revoke. Rotate by creating a new "
        "token, moving its users over, then revoking the old one.",
        no_args_is_help=True,
    )
    app.add_typer(tokens, name="tokens")

    @tokens.command("create")
    def tokens_create(
        kind: Annotated[str, typer.Argument(help="admin or join.")],
        expires: Annotated[
            str | None,
            typer.Option(help="Refuse the token after this long, e.g. 30m, 24h, 7d (default: never)."),
        ] = None,
        out: Annotated[
            Path | None,
            typer.Option("--out", help="Write the token to this file (0600) instead of showing it."),
        ] = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
        output: FormatOpt = Format.TABLE,
    ) -> None:
        """Create an admin or join token; it is shown (or written to --out) this once."""
        from fleetserve.secretfile import write_secret

        if kind not in ("admin", "join"):
            raise typer.BadParameter("admin or join", param_hint="KIND")
        try:
            seconds = parse_duration(expires) if expires else None
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--expires") from None
        console = Console(soft_wrap=True)
        data = call_as(
            CreatedToken, server, token, "POST", "/tokens", json={"kind": kind, "expiresIn": seconds}
        )
        until = f", expires {data.expires_at.isoformat()}" if data.expires_at else ""
        if out is not None:
            write_secret(out, data.token + "\n")
            console.print(f"{kind} token {data.id}{until}: written to {out} (0600)", markup=False)
        elif output is Format.TABLE:
            console.print(f"{kind} token {data.id}{until}: {data.token}", markup=False, highlight=False)
            console.print("shown once; only its hash is stored.", markup=False)
        else:
            emit(data, output, console)

    @tokens.command("list")
    def tokens_list(
        server: ServerOpt = None, token: TokenOpt = None, output: FormatOpt = Format.TABLE
    ) -> None:
        """List admin and join tokens (no secrets)."""
        console = Console(soft_wrap=True)
        data = call_all(TokenView, server, token, "GET", "/tokens")
        columns: tuple[Column, ...] = (
            ("id", lambda t: t.id), ("kind", lambda t: t.kind),
            ("created", lambda t: t.created_at.isoformat()),
            ("expires", lambda t: t.expires_at.isoformat() if t.expires_at else "never"),
            ("revoked", lambda t: t.revoked), ("valid", lambda t: t.valid),
        )  # fmt: skip
        emit(data, output, console, columns)

    @tokens.command("revoke")
    def tokens_revoke(
        token_id: Annotated[int, typer.Argument(help="The token's id (see `fleetserve tokens list`).")],
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Revoke an admin or join token at once. Nodes enrolled with a revoked join token keep
        their own credentials; the last valid admin token cannot be revoked."""
        call(server, token, "DELETE", f"/tokens/{token_id}")
        Console().print(f"token {token_id} revoked")

    nodes = typer.Typer(help="Node enrolment: approve a name, list what waits.", no_args_is_help=True)
    app.add_typer(nodes, name="nodes")

    @nodes.command("approve")
    def nodes_approve(
        name: Annotated[str, typer.Argument(help="The node's name.")],
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Approve what waits under NAME. A registration that claimed more hardware than approved
        (`nodes enrolments`, CLAIMED (WAITS)): its claim is applied and becomes the approved
        hardware. Otherwise: let the next join-token enrolment under NAME through, a new name or
        one enrolled already (the new enrolment's credential then replaces the old one)."""
        data = call_as(ApprovalView, server, token, "POST", f"/nodes/{name}/approve")
        if data.applied_hardware is not None:
            Console().print(
                f"node/{name}: the hardware it claims is approved: {data.applied_hardware.describe()}",
                markup=False,
            )
            return
        what = "re-enrolment" if data.enrolled else "enrolment"
        Console().print(f"node/{name}: the next {what} is approved", markup=False)

    @nodes.command("enrolments")
    def nodes_enrolments(
        server: ServerOpt = None, token: TokenOpt = None, output: FormatOpt = Format.TABLE
    ) -> None:
        """Every node name with a credential, an approval, or an enrolment request waiting; the
        hardware approved, and beside it a registration's claim beyond it that waits."""
        console = Console(soft_wrap=True)
        data = call_all(EnrolmentView, server, token, "GET", "/enrolments")
        columns: tuple[Column, ...] = (
            ("node", lambda e: e.node), ("enrolled", lambda e: e.enrolled),
            ("approved", lambda e: e.approved),
            ("requested", lambda e: e.requested_at.isoformat() if e.requested_at else ""),
            ("from", lambda e: e.requested_from or ""),
            ("approved hardware", lambda e: e.approved_hardware.describe() if e.approved_hardware else ""),
            ("claimed (waits)", lambda e: e.claimed_hardware.describe() if e.claimed_hardware else ""),
        )  # fmt: skip
        emit(data, output, console, columns)
