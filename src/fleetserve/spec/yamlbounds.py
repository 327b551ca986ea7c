"""YAML read with bounds, before anything is expanded: how large a document may grow through its
aliases, how deep it may nest, and how long its text may be.

PyYAML composes an alias as a reference to the anchored node, so a ten-line "billion laughs"
costs little until something walks it; every walker after (validation, JSON for the API) then
expands it (``apply -f`` took the client to 2 GB). ``safe_load_all`` counts the nodes each
document would have once expanded, from the composed graph (each node's count once, memoised),
and refuses one past ``MAX_NODES`` or nested past ``MAX_DEPTH`` as a YAML error at the anchor.
"""

from __future__ import annotations

from typing import Any

import yaml

from fleetserve.errors import FleetserveError

MAX_TEXT = 16 * 2**20  # characters of one YAML text
MAX_NODES = 1_000_000  # nodes of one document, aliases expanded
MAX_DEPTH = 200  # nesting of one document


class YamlTooLarge(FleetserveError, yaml.MarkedYAMLError):
    """A YAML document past a bound (expanded size, depth or text length); a YAML error too, so
    every reader that turns YAML errors into a ConfigError names it the same way."""


def _refuse(node: yaml.Node | None, problem: str) -> YamlTooLarge:
    return YamlTooLarge(problem=problem, problem_mark=node.start_mark if node is not None else None)


def _expanded(node: yaml.Node, memo: dict[int, int], depth: int) -> int:
    """How many nodes ``node`` stands for once every alias under it is expanded."""
    known = memo.get(id(node))
    if known is not None:
        if known < 0:
            raise _refuse(node, "an anchor refers to itself; write the value out")
        return known
    if depth > MAX_DEPTH:
        raise _refuse(node, f"the document nests deeper than {MAX_DEPTH} levels; flatten it")
    memo[id(node)] = -1  # on the path: an alias to it is a cycle
    total = 1
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            total += _expanded(item, memo, depth + 1)
    elif isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            total += _expanded(key, memo, depth + 1) + _expanded(value, memo, depth + 1)
    if total > MAX_NODES:
        raise _refuse(
            node,
            f"the document expands to more than {MAX_NODES:,} values through its aliases "
            "(an alias bomb?); write the values out, or split the document",
        )
    memo[id(node)] = total
    return total


class BoundedSafeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, each document checked against the bounds before it is constructed."""

    def get_node(self) -> Any:
        """The next document's node, refused if it expands past the bounds."""
        node = super().get_node()
        if node is not None:
            _expanded(node, {}, 0)
        return node


def safe_load_all(text: str) -> list[Any]:
    """Every document of ``text`` as plain data, within the bounds (``YamlTooLarge`` past one)."""
    if len(text) > MAX_TEXT:
        raise _refuse(None, f"the YAML text is longer than {MAX_TEXT:,} characters; split it into files")
    return list(yaml.load_all(text, Loader=BoundedSafeLoader))
