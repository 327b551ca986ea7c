"""Endpoints in the state store: stored, checked, changed and deleted on both backends; what moves
the change counter (the gateways' routes) and what does not; no key anywhere in the database."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from fleetserve.errors import NotFound
from fleetserve.spec.endpoint import Endpoint, EndpointState
from fleetserve.spec.loader import Documents
from fleetserve.store import SqlStore

T0 = datetime(2026, 12, 7, 3, 0, tzinfo=UTC)


def box(**fields: object) -> Endpoint:
    return Endpoint.model_validate(
        {
            "name": "box",
            "url": "http://10.0.0.7:11434",
            "models": {"chat": "llama3.2:3b"},
            "keyFile": "box.key",
        }
        | fields
    )


def test_an_endpoint_is_applied_checked_and_changed(store: SqlStore) -> None:
    assert store.apply_documents(Documents(endpoints=[box()])) == [("Endpoint", "box", "created")]
    (stored,) = store.list_endpoints()
    assert (stored.endpoint, stored.state, stored.last_error, stored.checked_at) == (
        box(),
        EndpointState.UNKNOWN,
        None,
        None,
    )
    assert store.set_endpoint_health("box", box(), EndpointState.NOT_READY, "GET /v1/models answered 401", T0)
    checked = store.get_endpoint("box")
    assert (checked.state, checked.last_error, checked.checked_at) == (
        EndpointState.NOT_READY,
        "GET /v1/models answered 401",
        T0,
    )
    assert store.put_endpoint(box()) == "unchanged"
    assert store.get_endpoint("box").state is EndpointState.NOT_READY
    # A new spec is checked afresh: Unknown until then, and a check of the old spec is not recorded.
    assert store.put_endpoint(box(weight=2)) == "configured"
    assert store.get_endpoint("box").state is EndpointState.UNKNOWN
    assert not store.set_endpoint_health("box", box(), EndpointState.READY, None, T0)
    assert store.set_endpoint_health("box", box(weight=2), EndpointState.READY, None, T0)
    assert store.get_endpoint("box").state is EndpointState.READY
    store.delete_endpoint("box")
    assert store.list_endpoints() == []
    with pytest.raises(NotFound):
        store.delete_endpoint("box")
    assert not store.set_endpoint_health("box", box(weight=2), EndpointState.READY, None, T0)


def test_a_new_state_moves_the_change_counter_and_a_check_that_confirms_it_does_not(store: SqlStore) -> None:
    before = store.fleet_changes()
    store.put_endpoint(box())
    created = store.fleet_changes()
    assert created > before
    store.set_endpoint_health("box", box(), EndpointState.READY, None, T0)
    ready = store.fleet_changes()
    assert ready > created
    store.set_endpoint_health("box", box(), EndpointState.READY, None, T0.replace(minute=1))
    assert store.fleet_changes() == ready
    store.put_endpoint(box(weight=3))
    assert store.fleet_changes() > ready


def test_the_error_kept_is_bounded(store: SqlStore) -> None:
    store.put_endpoint(box())
    store.set_endpoint_health("box", box(), EndpointState.NOT_READY, "x" * 10_000, T0)
    assert len(store.get_endpoint("box").last_error or "") == 512
