"""The admin API's shared values: the base of every answer, times, and the small acknowledgements."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, PlainSerializer
from pydantic.alias_generators import to_camel

V = TypeVar("V", bound=BaseModel)

# A time on the wire: ISO 8601 as ``datetime.isoformat`` writes it ("+00:00", not "Z").
IsoTime = Annotated[datetime, PlainSerializer(lambda v: v.isoformat(), return_type=str, when_used="json")]


class View(BaseModel):
    """Base of every admin API answer: camelCase names on the wire, snake_case in Python."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True)


class Deleted(View):
    """An object was deleted: its name."""

    deleted: str


class Revoked(View):
    """A key or token was revoked: its id."""

    revoked: int


def extend(view: type[V], document: BaseModel, **fields: Any) -> V:
    """``document`` with the server's ``fields`` added, as ``view``: every field of the document
    set (as its JSON has it), so an answer sent with only its set fields still holds all of them."""
    return view.model_validate({**document.model_dump(mode="json", by_alias=True), **fields})
