"""YAML bounded before it is expanded: the alias bomb of the audit is refused from the composed
graph, in little memory and time, by the spec loader and by ``apply -f``'s reader."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import pytest

from fleetserve.cli.views import read_documents
from fleetserve.errors import ConfigError
from fleetserve.spec.loader import load_text
from fleetserve.spec.yamlbounds import YamlTooLarge, safe_load_all

# Nine levels of ten aliases each: 10**9 values once expanded, 10 lines of text.
BOMB = "kind: Model\nname: m\na0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 10)
)


def test_an_alias_bomb_is_refused_in_bounded_memory_and_time() -> None:
    tracemalloc.start()
    started = time.process_time()
    try:
        with pytest.raises(YamlTooLarge, match="expands to more than 1,000,000 values"):
            safe_load_all(BOMB)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20
    assert time.process_time() - started < 2.0


def test_the_spec_loader_and_apply_f_refuse_the_bomb_saying_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"alias bomb.*write the values out"):
        load_text(BOMB, "bomb.yaml")
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB, encoding="utf-8")
    with pytest.raises(ConfigError, match=r"bomb\.yaml: not valid YAML: .*expands to more than"):
        read_documents([path])


def test_a_self_referring_anchor_and_deep_nesting_are_refused() -> None:
    with pytest.raises(YamlTooLarge, match="refers to itself"):
        safe_load_all("a: &x [*x]\n")
    with pytest.raises(YamlTooLarge, match="nests deeper than 200"):
        safe_load_all("[" * 250 + "]" * 250)


def test_aliases_within_the_bounds_load_as_before() -> None:
    assert safe_load_all("a: &x {b: 1}\nc: *x\n---\n- 1\n") == [{"a": {"b": 1}, "c": {"b": 1}}, [1]]
