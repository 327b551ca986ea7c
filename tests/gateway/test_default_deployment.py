"""The fleet's default deployment (``routing.default``): requests that name no model, or one no
deployment serves, go to it, as a lone llama-server serves whatever name it is sent; without one,
an unknown name is refused as before (a request naming none still takes the key's one model where
its route allows). At most one deployment of a fleet may be the default."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from builders import deployment
from fake_engine import ServedGateway, engines_on
from fleetserve.fleet import Documents, check_documents
from fleetserve.spec.resources import Model
from fleetserve.store.sql import SqlStore


def served(tmp_path: Path, default: bool) -> Iterator[ServedGateway]:
    with SqlStore.open(tmp_path / "state.db") as store, ServedGateway(store, engines=1) as gw:
        engines_on(store, [e.port for e in gw.engines], tmp_path / "tiny.gguf", routing={"default": default})
        deadline = time.monotonic() + 10
        while not (gw.gateway.table.routes.get("tiny") and gw.gateway.table.routes["tiny"].endpoints):
            assert time.monotonic() < deadline, "the replica never reached the routes"
            time.sleep(0.02)
        yield gw


@pytest.fixture
def with_default(tmp_path: Path) -> Iterator[ServedGateway]:
    yield from served(tmp_path, True)


@pytest.fixture
def without_default(tmp_path: Path) -> Iterator[ServedGateway]:
    yield from served(tmp_path, False)


def ask(gw: ServedGateway, models: list[str], body: dict[str, object]) -> httpx.Response:
    _, token = gw.store.create_api_key(f"k{time.monotonic_ns()}", models, None, None, datetime.now(UTC))
    return httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )


def test_a_request_naming_no_model_or_an_unknown_one_goes_to_the_default(with_default) -> None:
    for body in ({}, {"model": "gpt-3.5-turbo-instruct"}, {"model": "tiny"}):
        answer = ask(with_default, ["*"], body)
        assert answer.status_code == 200, (body, answer.text)
    # It is counted as the deployment that served it: no label from the client's string.
    assert "gpt-3.5-turbo-instruct" not in with_default.gateway.last_request
    assert "tiny" in with_default.gateway.last_request


def test_a_key_that_may_not_use_the_default_gets_what_it_got_before(with_default) -> None:
    answer = ask(with_default, ["other"], {"model": "gpt-4"})
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"
    assert ask(with_default, ["other"], {}).status_code == 404  # its one model, which nobody serves


def test_without_a_default_an_unknown_model_is_404(without_default) -> None:
    answer = ask(without_default, ["*"], {"model": "gpt-3.5-turbo-instruct"})
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"


def test_two_defaults_are_refused_naming_both() -> None:
    model = Model.model_validate({"name": "m", "source": "/m.gguf", "format": "gguf"})
    profile = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}}
    docs = Documents(
        models=[model],
        deployments=[
            deployment(name, 1, profile, model="m", routing={"default": True}) for name in ("a", "b")
        ],
    )
    problems = [p for p in check_documents(docs) if p.field == "routing.default"]
    assert {p.location for p in problems} == {"Deployment a", "Deployment b"}
    assert all("a, b" in p.message for p in problems)
