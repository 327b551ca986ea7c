"""The dashboard's scripts read the admin API by field name, and cannot import its models: every
property name they read must be one the admin API's schema (``adminapi``'s models, served at
/openapi.json) has, so renaming a field fails here, not in an operator's browser."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Any

from fleetserve.server.app import create_app
from fleetserve.store import SqlStore, make_engine, migrate

# Names the scripts read that are not the admin API's: the browser's and JavaScript's own (DOM,
# Array, Map, Response, ...), the scripts' own objects (a GPU group, a chart series), and the
# OpenAI-compatible gateway's answer that the playground reads.
NOT_API = frozenset((
    # The browser's and JavaScript's own.
    "_", "add", "addEventListener", "append", "appendChild", "assign", "background", "body",
    "bottom", "catch", "children", "classList", "className", "clientWidth", "clipboard", "close",
    "confirm", "cookie", "createElement", "createElementNS", "createTextNode", "dataset", "decode",
    "disabled", "endsWith", "entries", "fill", "filter", "find", "flatMap", "floor", "focus", "get",
    "getElementById", "getItem", "getReader", "getTime", "has", "hidden", "includes", "isArray",
    "isNaN", "join", "json", "left", "length", "localeCompare", "location", "log10", "map", "max",
    "min", "now", "parentElement", "parse", "pathname", "pop", "preventDefault", "push",
    "querySelectorAll", "read", "reduce", "remove", "replace", "replaceChildren", "reverse",
    "right", "round", "scrollHeight", "scrollTop", "search", "set", "setAttribute", "setItem",
    "showModal", "slice", "some", "sort", "split", "startsWith", "statusText", "stringify", "style",
    "text", "textContent", "then", "title", "toFixed", "toISOString", "toLocaleDateString",
    "toLocaleString", "toLocaleTimeString", "top", "trim", "values", "width", "writeText",
    # The scripts' own objects, and an error's problems (``field``: errors are not a model here).
    "ask", "cls", "colour", "delta", "deps", "device", "dialog", "field", "groups", "held", "js",
    "meter", "names", "new", "ordered", "org", "page", "pct", "playground", "power", "render",
    "rest", "running", "series", "swatch", "uncordon", "util", "vendor", "w3",
    # The gateway's answer (the playground).
    "choices", "completion_tokens", "content", "temperature", "usage",
))  # fmt: skip
PROPERTY = re.compile(r"\.([A-Za-z_]\w*)")


def _schema_names(node: Any, into: set[str]) -> set[str]:
    if isinstance(node, dict):
        if isinstance(node.get("properties"), dict):
            into.update(node["properties"])
        for value in node.values():
            _schema_names(value, into)
    elif isinstance(node, list):
        for value in node:
            _schema_names(value, into)
    return into


def test_every_field_the_dashboard_reads_is_in_the_admin_api_schema(tmp_path: Path) -> None:
    engine = make_engine(tmp_path / "fleet.db")
    migrate(engine)
    spec = create_app(SqlStore(engine), gateway=False).openapi()
    admin = {path: ops for path, ops in spec["paths"].items() if not path.startswith("/api/v1/agent")}
    fields = _schema_names([admin, spec["components"]["schemas"]], set())
    scripts = resources.files("fleetserve.ui") / "static"
    read: dict[str, set[str]] = {}
    for script in scripts.iterdir():
        if script.name.endswith(".js"):
            for name in PROPERTY.findall(script.read_text(encoding="utf-8")):
                read.setdefault(name, set()).add(script.name)
    unknown = {name: sorted(files) for name, files in read.items() if name not in fields | NOT_API}
    assert not unknown, f"the dashboard reads fields no admin API model has: {unknown}"


def test_the_admin_api_answers_every_route_with_a_schema(tmp_path: Path) -> None:
    engine = make_engine(tmp_path / "fleet.db")
    migrate(engine)
    spec = create_app(SqlStore(engine), gateway=False).openapi()
    untyped = [
        f"{method.upper()} {path}"
        for path, ops in spec["paths"].items()
        if path.startswith("/api/v1/") and not path.startswith("/api/v1/agent")
        for method, op in ops.items()
        if "$ref" not in str(op["responses"]["200"]["content"]["application/json"]["schema"])
    ]
    assert not untyped, untyped
