"""Printing API objects as a table, JSON or YAML."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any

import typer
import yaml
from rich.console import Console
from rich.table import Table

from fleetserve.cli.client import ClientError
from fleetserve.errors import ConfigError, FleetserveError


class Format(StrEnum):
    """How a command prints what it got."""

    TABLE = "table"
    JSON = "json"
    YAML = "yaml"


Column = tuple[str, Callable[[dict[str, Any]], Any]]


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, list | tuple):
        return ", ".join(_cell(v) for v in value)
    return str(value)


def emit(data: Any, fmt: Format, console: Console, columns: Sequence[Column] = ()) -> None:
    """Print ``data`` (a dict or a list of dicts) in the chosen format."""
    if fmt is Format.JSON:
        console.print_json(json.dumps(data))
        return
    if fmt is Format.YAML:
        console.print(yaml.safe_dump(data, sort_keys=False).rstrip(), markup=False, highlight=False)
        return
    rows = data if isinstance(data, list) else [data]
    if not columns:
        console.print(yaml.safe_dump(data, sort_keys=False).rstrip(), markup=False, highlight=False)
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
