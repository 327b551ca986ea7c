"""Fixtures for the control plane's suites: the example fleets and two stores sharing one database.

The ``store`` fixture (tests/conftest.py) runs every test on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import Engine
from starlette.exceptions import StarletteDeprecationWarning

from fleetserve.store import SqlStore, make_engine, migrate

# starlette warns, when its test client is first imported, that it prefers ``httpx2`` to the
# ``httpx`` this project pins. The suite turns warnings into errors, so import it here first with
# that one warning silenced: the test modules then find the module already loaded.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    import fastapi.testclient  # noqa: F401

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted((EXAMPLES / name).glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    assert docs, f"no documents under {EXAMPLES / name}"
    return docs


@pytest.fixture
def datacenter() -> list[dict[str, Any]]:
    """Every document of examples/datacenter/*.yaml, as ``fleetserve apply -f`` sends them."""
    return _example("datacenter")


@pytest.fixture(params=["sqlite", "postgres"])
def two_stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[SqlStore, SqlStore]]:
    """Two stores, each with its own engine, over ONE database: two servers sharing state."""
    engines: list[Engine] = []
    try:
        if request.param == "sqlite":
            engines.append(make_engine(tmp_path / "shared.db"))
            migrate(engines[0])
            engines.append(make_engine(tmp_path / "shared.db"))
            yield SqlStore(engines[0]), SqlStore(engines[1])
        else:
            url: str = request.getfixturevalue("postgres_url")
            schema: str = request.getfixturevalue("postgres_schema")
            # postgres_store empties the module's schema; a second engine joins it the way
            # tests/conftest.py builds the first.
            first: SqlStore = request.getfixturevalue("postgres_store")
            engines.append(make_engine(url, connect_args={"options": f"-csearch_path={schema}"}))
            yield first, SqlStore(engines[0])
    finally:
        for engine in engines:
            engine.dispose()
