"""Errors as HTTP answers: bad input is a 4xx naming the field and the reason, never a 500.

Every error body has one shape: ``{"error": {"type", "message", "problems": [{location, field,
message}]}}``, so the CLI and scripts can print the field without parsing prose.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fleetserve.errors import (
    AllocationConflict,
    ConfigError,
    FleetserveError,
    NotFound,
    Problem,
    StaleEpoch,
    StoreError,
    UnknownNode,
    UnknownReplica,
)


class Unauthorized(FleetserveError):
    """The request carries no valid credentials for this API."""


class Forbidden(FleetserveError):
    """The credentials are valid, but not for this: e.g. one node speaking for another (403)."""


class EnrolmentRefused(FleetserveError):
    """An enrolment with the join token needs an operator's approval; ``kind`` says why
    (``name_taken`` → 409, ``approval_required`` → 403)."""

    def __init__(self, kind: str, status: int, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


def error_body(kind: str, message: str, problems: Sequence[Problem] = ()) -> dict[str, Any]:
    """The one error shape of the admin API."""
    return {
        "error": {
            "type": kind,
            "message": message,
            "problems": [{"location": p.location, "field": p.field, "message": p.message} for p in problems],
        }
    }


# The errors whose answer is their message: (error type, HTTP status), one row per exception,
# a subclass before its base (NotFound is a StoreError).
ANSWERS: dict[type[FleetserveError], tuple[str, int]] = {
    NotFound: ("not_found", 404),
    UnknownNode: ("not_found", 404),
    UnknownReplica: ("not_found", 404),
    StaleEpoch: ("stale_epoch", 409),
    AllocationConflict: ("conflict", 409),
    StoreError: ("store_unavailable", 503),
}


def _loc(loc: Sequence[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts)


def install(app: FastAPI) -> None:
    """Register the exception handlers that turn fleetserve errors into HTTP answers."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [
            Problem(
                "request", _loc(e.get("loc", ())), str(e.get("msg", "invalid")).removeprefix("Value error, ")
            )
            for e in exc.errors()
        ]
        return JSONResponse(
            error_body("invalid_request", "the request is invalid", problems), status_code=422
        )

    @app.exception_handler(ConfigError)
    async def _config(request: Request, exc: ConfigError) -> JSONResponse:
        return JSONResponse(
            error_body("invalid_document", f"{len(exc.problems)} problem(s) in the input", exc.problems),
            status_code=422,
        )

    async def _known(request: Request, exc: Exception) -> JSONResponse:
        kind, status = next(answer for cls, answer in ANSWERS.items() if isinstance(exc, cls))
        return JSONResponse(error_body(kind, str(exc)), status_code=status)

    for cls in ANSWERS:
        app.add_exception_handler(cls, _known)

    @app.exception_handler(Unauthorized)
    async def _unauthorized(request: Request, exc: Unauthorized) -> JSONResponse:
        return JSONResponse(
            error_body("unauthorized", str(exc)), status_code=401, headers={"WWW-Authenticate": "Bearer"}
        )

    @app.exception_handler(Forbidden)
    async def _forbidden(request: Request, exc: Forbidden) -> JSONResponse:
        return JSONResponse(error_body("forbidden", str(exc)), status_code=403)

    @app.exception_handler(EnrolmentRefused)
    async def _refused(request: Request, exc: EnrolmentRefused) -> JSONResponse:
        return JSONResponse(error_body(exc.kind, str(exc)), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body("http_error", str(exc.detail)), status_code=exc.status_code)
