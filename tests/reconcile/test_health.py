"""Node liveness from heartbeat age, with the clock passed in."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from fleetserve.reconcile.health import HeartbeatPolicy, Transition, classify, transitions
from fleetserve.spec.resources import NodeState

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
POLICY = HeartbeatPolicy(not_ready_after=timedelta(seconds=40), lost_after=timedelta(minutes=5))


@pytest.mark.parametrize(
    ("silent", "state"),
    [
        (timedelta(seconds=0), NodeState.READY),
        (timedelta(seconds=39), NodeState.READY),
        (timedelta(seconds=40), NodeState.NOT_READY),
        (timedelta(minutes=4, seconds=59), NodeState.NOT_READY),
        (timedelta(minutes=5), NodeState.LOST),
        (timedelta(days=3), NodeState.LOST),
    ],
)
def test_silence_moves_a_node_from_ready_to_not_ready_to_lost(silent, state):
    assert classify(NOW - silent, NOW, POLICY) is state


def test_a_node_no_agent_ever_ran_on_keeps_its_declared_state():
    assert transitions([("static", NodeState.READY, None)], NOW, POLICY) == []


def test_only_real_changes_are_reported_and_silence_never_revives_a_node():
    nodes = [
        ("fresh", NodeState.READY, NOW),
        ("quiet", NodeState.READY, NOW - timedelta(minutes=1)),
        ("gone", NodeState.NOT_READY, NOW - timedelta(minutes=10)),
        ("back", NodeState.NOT_READY, NOW),
        ("lost", NodeState.LOST, NOW),
    ]
    assert transitions(nodes, NOW, POLICY) == [
        Transition("quiet", NodeState.READY, NodeState.NOT_READY),
        Transition("gone", NodeState.NOT_READY, NodeState.LOST),
    ]


def test_the_lost_deadline_must_be_longer_than_the_not_ready_one():
    with pytest.raises(ValueError, match="lost_after"):
        HeartbeatPolicy(not_ready_after=timedelta(minutes=5), lost_after=timedelta(minutes=1))
