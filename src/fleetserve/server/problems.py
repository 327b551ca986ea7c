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


def error_body(kind: str, message: str, problems: Sequence[Problem] = ()) -> dict[str, Any]:
    """The one error shape of the admin API."""
    return {
        "error": {
            "type": kind,
            "message": message,
            "problems": [{"location": p.location, "field": p.field, "message": p.message} for p in problems],
        }
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

    @app.exception_handler(NotFound)
    @app.exception_handler(UnknownNode)
    @app.exception_handler(UnknownReplica)
    async def _missing(request: Request, exc: FleetserveError) -> JSONResponse:
        return JSONResponse(error_body("not_found", str(exc)), status_code=404)

    @app.exception_handler(StaleEpoch)
    async def _stale(request: Request, exc: StaleEpoch) -> JSONResponse:
        return JSONResponse(error_body("stale_epoch", str(exc)), status_code=409)

    @app.exception_handler(AllocationConflict)
    async def _conflict(request: Request, exc: AllocationConflict) -> JSONResponse:
        return JSONResponse(error_body("conflict", str(exc)), status_code=409)

    @app.exception_handler(StoreError)
    async def _store(request: Request, exc: StoreError) -> JSONResponse:
        return JSONResponse(error_body("store_unavailable", str(exc)), status_code=503)

    @app.exception_handler(Unauthorized)
    async def _unauthorized(request: Request, exc: Unauthorized) -> JSONResponse:
        return JSONResponse(
            error_body("unauthorized", str(exc)), status_code=401, headers={"WWW-Authenticate": "Bearer"}
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body("http_error", str(exc.detail)), status_code=exc.status_code)
