"""Every refusal of the agents' door (``server/agents/door.py``), from ONE table of problems.

A refusal is a value: a ``Reason`` from a closed enum, the facts its sentence names (node,
state, limit...) and, for a 422, the problems (field and reason). ``answer`` renders it in the
error shape of the whole API (``server/problems.py`` ``error_body``), with the status, type and
headers of its row: the same answers the FastAPI routes gave before the door answered every
case itself (the agent's client, ``agent/client.py``, reads the type: ``stale_epoch`` means
register again). The credential sentences are also those of the token check of the agents'
other routes (``server/auth.py``), and the 413's that of their body limits (``limits.py``).

    reason              status  type               when
    NO_CREDENTIAL       401     unauthorized       no ``Authorization: Bearer`` token
    JOIN_TOKEN          401     unauthorized       the join token, which only enrols
    NOT_A_CREDENTIAL    401     unauthorized       no node's credential (wrong, retired, deleted)
    UNPARSABLE_BODY     400     http_error         a JSON body that is not even text
    METHOD_NOT_ALLOWED  405     http_error         the call by another method
    ANOTHER_NODE        403     forbidden          a node's credential naming another node
    UNKNOWN_NODE        404     not_found          the named node is not registered
    STALE_EPOCH         409     stale_epoch        an older registration of the node
    NOT_READY           409     stale_epoch        judged Lost while silent
    BODY_TOO_LARGE      413     body_too_large     over the call's limit (declared, or as read)
    INVALID_REQUEST     422     invalid_request    a body or query that does not validate
    INVALID_DOCUMENT    422     invalid_document   a report's GPU samples not its own
    STORE_UNAVAILABLE   503     store_unavailable  the state store failed
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from pydantic_core import ErrorDetails

from fleetserve.errors import Problem
from fleetserve.rawasgi.answers import JSON, answer
from fleetserve.rawasgi.types import Header, Send
from fleetserve.server.problems import error_body
from fleetserve.store.acceptance import Judgement, Verdict


class Reason(StrEnum):
    """Why the agents' door refused a call (one row of ``PROBLEMS`` each)."""

    NO_CREDENTIAL = "no_credential"
    JOIN_TOKEN = "join_token"
    NOT_A_CREDENTIAL = "not_a_credential"
    UNPARSABLE_BODY = "unparsable_body"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    ANOTHER_NODE = "another_node"
    UNKNOWN_NODE = "unknown_node"
    STALE_EPOCH = "stale_epoch"
    NOT_READY = "not_ready"
    BODY_TOO_LARGE = "body_too_large"
    INVALID_REQUEST = "invalid_request"
    INVALID_DOCUMENT = "invalid_document"
    STORE_UNAVAILABLE = "store_unavailable"


@dataclass(frozen=True)
class ProblemRow:
    """How one reason is answered: status, error type, the sentence (``str.format`` over the
    refusal's facts) and extra headers."""

    status: int
    kind: str
    message: str
    headers: tuple[Header, ...] = ()


_CHALLENGE: tuple[Header, ...] = ((b"www-authenticate", b"Bearer"),)

PROBLEMS: Mapping[Reason, ProblemRow] = MappingProxyType(
    {
        Reason.NO_CREDENTIAL: ProblemRow(
            401,
            "unauthorized",
            "this API needs a node credential (or, to enrol, the join token) as "
            "'Authorization: Bearer TOKEN'",
            _CHALLENGE,
        ),
        Reason.JOIN_TOKEN: ProblemRow(
            401,
            "unauthorized",
            "the join token only enrols (POST /api/v1/agent/register); every other agent route needs "
            "the node's own credential, which enrolment returns",
            _CHALLENGE,
        ),
        Reason.NOT_A_CREDENTIAL: ProblemRow(
            401,
            "unauthorized",
            "the token is not a node credential or a valid join token (wrong, revoked, expired, or its "
            "node was deleted: enrol again)",
            _CHALLENGE,
        ),
        Reason.UNPARSABLE_BODY: ProblemRow(400, "http_error", "There was an error parsing the body"),
        Reason.METHOD_NOT_ALLOWED: ProblemRow(405, "http_error", "Method Not Allowed"),
        Reason.ANOTHER_NODE: ProblemRow(
            403, "forbidden", "this credential is node {own}'s; it cannot speak for node {node}"
        ),
        Reason.UNKNOWN_NODE: ProblemRow(
            404, "not_found", "no node named {node!r} is registered; register first"
        ),
        # The message never names the current epoch: it is the node's to know, not a caller's.
        Reason.STALE_EPOCH: ProblemRow(
            409,
            "stale_epoch",
            "node {node} registered again since this registration; register again and stop every "
            "replica not assigned",
        ),
        # A Lost node (its replicas re-placed): only a registration brings it back, and tells the
        # agent which replicas moved meanwhile.
        Reason.NOT_READY: ProblemRow(
            409, "stale_epoch", "node {node} was marked {state} while silent; register again"
        ),
        Reason.BODY_TOO_LARGE: ProblemRow(
            413, "body_too_large", "the body of {method} {path} is over its limit of {size} ({limit} bytes)"
        ),
        Reason.INVALID_REQUEST: ProblemRow(422, "invalid_request", "the request is invalid"),
        Reason.INVALID_DOCUMENT: ProblemRow(422, "invalid_document", "{count} problem(s) in the input"),
        Reason.STORE_UNAVAILABLE: ProblemRow(503, "store_unavailable", "{error}"),
    }
)

# The rule's verdicts (``store/acceptance.py``) as refusals.
VERDICTS: Mapping[Verdict, Reason] = MappingProxyType(
    {
        Verdict.UNKNOWN_CREDENTIAL: Reason.NOT_A_CREDENTIAL,
        Verdict.ANOTHER_NODE: Reason.ANOTHER_NODE,
        Verdict.UNKNOWN_NODE: Reason.UNKNOWN_NODE,
        Verdict.STALE_EPOCH: Reason.STALE_EPOCH,
        Verdict.NOT_READY: Reason.NOT_READY,
    }
)


@dataclass(frozen=True)
class Refusal:
    """A refused call: why, the facts its sentence names, and the problems of a 422."""

    reason: Reason
    facts: Mapping[str, object] = field(default_factory=dict)
    problems: Sequence[Problem] = ()

    @property
    def status(self) -> int:
        return PROBLEMS[self.reason].status

    def message(self) -> str:
        return PROBLEMS[self.reason].message.format(**self.facts)

    def body(self) -> bytes:
        """The error document, as the API's exception handlers serialise it."""
        row = PROBLEMS[self.reason]
        document = error_body(row.kind, self.message(), self.problems)
        return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()


async def refuse(send: Send, refusal: Refusal) -> None:
    """Send ``refusal`` as the whole response."""
    await answer(send, refusal.status, refusal.body(), [JSON, *PROBLEMS[refusal.reason].headers])


def judged(judgement: Judgement, node: str) -> Refusal:
    """The refusal of a call the rule refused (``judgement`` not accepted), naming ``node``."""
    state = judgement.state.value if judgement.state is not None else ""
    return Refusal(VERDICTS[judgement.verdict], {"node": node, "own": judgement.bound, "state": state})


def _field(loc: Sequence[int | str]) -> str:
    return ".".join(str(p) for p in loc if p not in ("body", "query", "path", "header"))


def invalid(errors: Sequence[ErrorDetails]) -> Refusal:
    """A 422 naming each field and its reason, worded as pydantic words them (as the API's
    validation handler does, ``server/problems.py``)."""
    problems = [
        Problem("request", _field(e["loc"]), str(e.get("msg", "invalid")).removeprefix("Value error, "))
        for e in errors
    ]
    return Refusal(Reason.INVALID_REQUEST, problems=problems)


def too_large(method: str, path: str, limit: int) -> Refusal:
    """The 413 of a body over ``limit`` bytes."""
    return Refusal(
        Reason.BODY_TOO_LARGE, {"method": method, "path": path, "size": _size(limit), "limit": limit}
    )


def _size(n: int) -> str:
    kib, mib = 1024, 1024 * 1024
    return f"{n // mib} MiB" if n % mib == 0 else f"{n // kib} KiB" if n % kib == 0 else f"{n} B"
