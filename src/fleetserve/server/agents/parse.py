"""What the agents' door reads from a request: a JSON body as a ``fleetserve.protocol`` model, and
the assignments poll's query (``PollQuery``: its bounds stated once, here).

Both are judged as FastAPI judged them when the calls were routes, so an agent (and every test)
reads the same answers: a body is JSON only under a JSON Content-Type (``application/json`` or
``…+json``), an empty body is a missing one, and a 422 names each field with pydantic's own
words. The common case costs one parse (``model_validate_json``); only a body that fails it is
parsed again, the slow way, to word the refusal as FastAPI would.
"""

from __future__ import annotations

import email.message
import json
from typing import TypeVar
from urllib.parse import parse_qsl

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleetserve.errors import Problem
from fleetserve.server.agents.refusals import Reason, Refusal, invalid
from fleetserve.spec.base import NAME_PATTERN

M = TypeVar("M", bound=BaseModel)

# The longest an assignments poll is held open waiting for a change.
MAX_WAIT_SECONDS = 30.0


class PollQuery(BaseModel):
    """An assignments poll's query: the node and the registration it speaks for, the revision
    the agent holds (None: none yet) and how long it may be held, in seconds. Other parameters
    are ignored; a parameter given twice counts its last value."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    node: str = Field(min_length=1, max_length=63, pattern=NAME_PATTERN)
    epoch: int = Field(ge=1, le=2**31 - 1)
    since: str | None = Field(default=None, max_length=64, pattern=r"^[0-9a-f]*$")
    wait: float = Field(default=0.0, ge=0, le=MAX_WAIT_SECONDS)


def poll_query(query_string: bytes) -> PollQuery | Refusal:
    """The poll a query string asks for, or the 422 naming what is wrong with it."""
    params = dict(parse_qsl(query_string.decode("latin-1"), keep_blank_values=True))
    try:
        return PollQuery.model_validate(params)
    except ValidationError as exc:
        return invalid(exc.errors(include_url=False))


def is_json(content_type: bytes | None) -> bool:
    """Whether a Content-Type says JSON (``application/json`` or ``application/…+json``)."""
    if content_type is None:
        return False
    if content_type.split(b";", 1)[0].strip().lower() == b"application/json":
        return True  # the agents' own: no header parsing
    message = email.message.Message()
    message["content-type"] = content_type.decode("latin-1")
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def json_body(model: type[M], body: bytes, content_type: bytes | None) -> M | Refusal:
    """``body`` as ``model``, or the refusal that explains why not (400 for a JSON body that is
    not text, 422 otherwise)."""
    declared_json = is_json(content_type)
    if body and declared_json:
        try:
            return model.model_validate_json(body)
        except ValidationError:
            pass  # worded below, as FastAPI would
    value: object = body if body else None
    if body and declared_json:
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            return Refusal(
                Reason.INVALID_REQUEST, problems=[Problem("request", str(exc.pos), "JSON decode error")]
            )
        except (ValueError, RecursionError):
            return Refusal(Reason.UNPARSABLE_BODY)
    if value is None:
        return Refusal(Reason.INVALID_REQUEST, problems=[Problem("request", "", "Field required")])
    try:
        return model.model_validate(value, from_attributes=True)
    except ValidationError as exc:
        return invalid(exc.errors(include_url=False))
