"""The agents' door in the OpenAPI document: its three calls are no FastAPI routes (``door.py``),
so FastAPI does not describe them; ``document`` adds them to the app's document, from the same
models the door reads and writes (``fleetserve.protocol``, ``parse.PollQuery``), with the error
shape of every refusal. Nothing here answers a request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode

from fleetserve.protocol import AssignmentSet, HeartbeatReply, HeartbeatRequest, StatusReply, StatusReport
from fleetserve.server.agents.door import ASSIGNMENTS, HEARTBEAT, STATUS
from fleetserve.server.agents.parse import PollQuery
from fleetserve.server.agents.refusals import PROBLEMS

# The door's schemas live under their own names in ``components/schemas``: FastAPI's (from the
# routes) may describe the same model in another mode.
_PREFIX = "agent."
_ERROR = {"$ref": "#/components/schemas/agent.Error"}
_ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "type": {"type": "string"},
                "message": {"type": "string"},
                "problems": {"type": "array", "items": {"type": "object"}},
            },
        }
    },
}


def _schema(model: type[BaseModel], mode: JsonSchemaMode, schemas: dict[str, Any]) -> dict[str, Any]:
    """A reference to ``model``'s schema, added (with its definitions) to ``schemas``."""
    schema = model.model_json_schema(
        by_alias=True,
        mode=mode,
        ref_template=f"#/components/schemas/{_PREFIX}{{model}}",
    )
    for name, definition in schema.pop("$defs", {}).items():
        schemas.setdefault(_PREFIX + name, definition)
    schemas.setdefault(_PREFIX + model.__name__, schema)
    return {"$ref": f"#/components/schemas/{_PREFIX}{model.__name__}"}


def _responses(ok: dict[str, Any], summary: str) -> dict[str, Any]:
    statuses = sorted({row.status for row in PROBLEMS.values()})
    out: dict[str, Any] = {"200": {"description": summary, "content": {"application/json": {"schema": ok}}}}
    for status in statuses:
        out[str(status)] = {"description": "refused", "content": {"application/json": {"schema": _ERROR}}}
    return out


def paths(schemas: dict[str, Any]) -> dict[str, Any]:
    """The door's three operations, their schemas added to ``schemas``."""
    security: list[dict[str, list[str]]] = [{"HTTPBearer": []}]
    query = PollQuery.model_json_schema()
    parameters = [
        {"name": name, "in": "query", "required": name in query.get("required", ()), "schema": spec}
        for name, spec in query["properties"].items()
    ]

    def body(model: type[BaseModel]) -> dict[str, Any]:
        return {
            "required": True,
            "content": {"application/json": {"schema": _schema(model, "validation", schemas)}},
        }

    return {
        HEARTBEAT: {
            "post": {
                "tags": ["agent"],
                "summary": "Say the node is alive; 409 for an older registration or a dead node",
                "operationId": "agent_heartbeat",
                "security": security,
                "requestBody": body(HeartbeatRequest),
                "responses": _responses(_schema(HeartbeatReply, "serialization", schemas), "recorded"),
            }
        },
        STATUS: {
            "post": {
                "tags": ["agent"],
                "summary": "Report replica states, cache contents, downloads and GPU samples",
                "operationId": "agent_status",
                "security": security,
                "requestBody": body(StatusReport),
                "responses": _responses(
                    _schema(StatusReply, "serialization", schemas), "the replicas to stop"
                ),
            }
        },
        ASSIGNMENTS: {
            "get": {
                "tags": ["agent"],
                "summary": "The replicas a node must run; held open until they change",
                "operationId": "agent_assignments",
                "security": security,
                "parameters": parameters,
                "responses": _responses(
                    _schema(AssignmentSet, "serialization", schemas), "the assignment set"
                ),
            }
        },
    }


def document(app: FastAPI) -> None:
    """Describe the door's calls in ``app``'s OpenAPI document (built once, when first asked)."""
    build: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            schemas.setdefault("agent.Error", _ERROR_SCHEMA)
            schema.setdefault("paths", {}).update(paths(schemas))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
