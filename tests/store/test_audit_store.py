"""The audit log on SQLite and PostgreSQL: recorded, read newest first within bounds, pruned."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from fleetserve.store import SqlStore
from fleetserve.store.audit import MAX_EVENTS, AuditAction, AuditEntry

T0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def test_events_come_back_newest_first_with_everything_recorded(store: SqlStore) -> None:
    store.record_event("admin token 1", AuditAction.CORDON, "Node/n1", {"reason": "fan"}, "10.0.0.5", T0)
    store.record_events(
        [
            AuditEntry("admin token 2", AuditAction.APPLY, "Model/a", {"result": "created"}),
            AuditEntry("admin token 2", AuditAction.APPLY, "Deployment/a", {"result": "created"}),
        ],
        T0 + timedelta(minutes=1),
    )
    events = store.events()
    assert [(e.actor, e.action, e.target) for e in events] == [
        ("admin token 2", "apply", "Deployment/a"),  # same time: the later id first
        ("admin token 2", "apply", "Model/a"),
        ("admin token 1", "cordon", "Node/n1"),
    ]
    assert events[-1].detail == {"reason": "fan"} and events[-1].source == "10.0.0.5"
    assert events[-1].at == T0 and events[0].source is None


def test_events_filter_by_time_and_action_and_stop_at_the_limit(store: SqlStore) -> None:
    for minute in range(5):
        action = AuditAction.DRAIN if minute % 2 else AuditAction.UNCORDON
        store.record_event(
            "admin token 1", action, f"Node/n{minute}", {}, None, T0 + timedelta(minutes=minute)
        )
    assert [e.target for e in store.events(since=T0 + timedelta(minutes=3))] == ["Node/n4", "Node/n3"]
    assert [e.target for e in store.events(action=AuditAction.DRAIN)] == ["Node/n3", "Node/n1"]
    assert [e.target for e in store.events(limit=2)] == ["Node/n4", "Node/n3"]


@pytest.mark.parametrize("limit", [0, MAX_EVENTS + 1])
def test_a_limit_out_of_bounds_is_refused(store: SqlStore, limit: int) -> None:
    with pytest.raises(ValueError, match="limit"):
        store.events(limit=limit)


def test_prune_drops_the_events_before_the_bound_only(store: SqlStore) -> None:
    for day in range(3):
        store.record_event(
            "admin token 1", AuditAction.DELETE, f"Model/m{day}", {}, None, T0 + timedelta(days=day)
        )
    assert store.prune_events(T0 + timedelta(days=1)) == 1
    assert [e.target for e in store.events()] == ["Model/m2", "Model/m1"]
