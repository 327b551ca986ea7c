"""Printing API objects as a table, JSON or YAML."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any

import typer
import yaml
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from fleetserve.cli.client import ClientError
from fleetserve.errors import ConfigError, FleetserveError


class Format(StrEnum):
    """How a command prints what it got."""

    TABLE = "table"
    JSON = "json"
    YAML = "yaml"


# A table column: its header and what a row (an answer's model, or plain data) shows in it.
Column = tuple[str, Callable[[Any], Any]]


def plain(data: Any) -> Any:
    """``data`` as JSON-ready values: an answer read as a model (``adminapi``) as the JSON it was
    read from (the fields the server sent), lists item by item, anything else as it is."""
    if isinstance(data, BaseModel):
        return data.model_dump(mode="json", by_alias=True, exclude_unset=True)
    if isinstance(data, list):
        return [plain(item) for item in data]
    return data


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, list | tuple):
        return ", ".join(_cell(v) for v in value)
    return str(value)


def emit(data: Any, fmt: Format, console: Console, columns: Sequence[Column] = ()) -> None:
    """Print ``data`` (a model or a dict, or a list of them) in the chosen format."""
    if fmt is Format.JSON:
        console.print_json(json.dumps(plain(data)))
        return
    rows = data if isinstance(data, list) else [data]
    if fmt is Format.YAML or not columns:
        console.print(yaml.safe_dump(plain(data), sort_keys=False).rstrip(), markup=False, highlight=False)
        return
    if not console.is_terminal:
        # Piped output: one row per line rather than cells wrapped at 80 columns.
        console = Console(width=250, file=console.file)
    table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for name, _ in columns:
        table.add_column(name.upper())
    for row in rows:
        table.add_row(*(_cell(get(row)) for _, get in columns))
    console.print(table)


def fail(err: FleetserveError) -> typer.Exit:
    """Print a fleetserve error for a person; the exit to raise (2: bad input, 1: anything else)."""
    console = Console(stderr=True, soft_wrap=True)
    if isinstance(err, ConfigError):
        console.print(f"[red]error:[/] {len(err.problems)} problem(s) in the input:")
        for problem in err.problems:
            console.print(f"  {problem}", markup=False)
        return typer.Exit(2)
    console.print(f"error: {err}", markup=False)
    if isinstance(err, ClientError):
        for p in err.problems:
            where = " ".join(x for x in (p.get("location"), p.get("field")) if x)
            console.print(f"  {where}: {p.get('message')}", markup=False)
        return typer.Exit(2 if err.status in (400, 404, 409, 422) else 1)
    return typer.Exit(1)
