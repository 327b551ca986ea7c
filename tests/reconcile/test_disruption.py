"""The fleet's liveness judged as a whole (``reconcile/disruption.py``): NotReady and Lost from
heartbeat arrival, the server's own stalls, disruption mode and the re-placement rate, with both
clocks passed in."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetserve.reconcile.disruption import Liveness, judge, stall_after
from fleetserve.reconcile.health import DisruptionPolicy, HeartbeatPolicy, Transition
from fleetserve.spec.resources import NodeState

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
POLICY = HeartbeatPolicy(timedelta(seconds=40), timedelta(seconds=300))
READY, NOT_READY, LOST = NodeState.READY, NodeState.NOT_READY, NodeState.LOST
FRESH = timedelta(seconds=1)
SILENT = timedelta(seconds=60)  # past NotReady
GONE = timedelta(seconds=400)  # past Lost


def fleet(*groups: tuple[int, NodeState, timedelta | None]) -> list[tuple[str, NodeState, datetime | None]]:
    """Nodes n0, n1, ... in groups of (count, stored state, silence; None: never heard)."""
    out = []
    for count, state, silence in groups:
        for _ in range(count):
            out.append((f"n{len(out):02}", state, None if silence is None else NOW - silence))
    return out


@dataclass(frozen=True)
class Case:
    name: str
    nodes: list[tuple[str, NodeState, datetime | None]]
    moves: dict[NodeState, int]  # transitions into each state
    disrupted: bool
    held: int = 0
    policy: HeartbeatPolicy = POLICY


CASES = [
    Case("a quiet fleet moves nothing", fleet((10, READY, FRESH)), {}, False),
    Case(
        "one silent node of ten goes NotReady",
        fleet((9, READY, FRESH), (1, READY, SILENT)),
        {NOT_READY: 1},
        False,
    ),
    Case(
        "one node past the Lost deadline is judged Lost",
        fleet((9, READY, FRESH), (1, NOT_READY, GONE)),
        {LOST: 1},
        False,
    ),
    Case(
        "half the fleet silent is under the 55% share: judged as usual (one Lost per token)",
        fleet((5, READY, FRESH), (5, NOT_READY, GONE)),
        {LOST: 1},
        False,
        held=4,
    ),
    Case(
        "six of ten silent is disruption mode: NotReady marked, nobody Lost",
        fleet((4, READY, FRESH), (3, READY, SILENT), (3, NOT_READY, GONE)),
        {NOT_READY: 3},
        True,
        held=3,
    ),
    Case(
        "a whole fleet past the Lost deadline at once: NotReady, none Lost",
        fleet((200, READY, GONE)),
        {NOT_READY: 200},
        True,
        held=200,
    ),
    Case(
        "two of three silent is under the three-node floor: judged as usual",
        fleet((1, READY, FRESH), (2, NOT_READY, GONE)),
        {LOST: 1},
        False,
        held=1,
    ),
    Case(
        "two of three silent with a floor of two is disruption mode",
        fleet((1, READY, FRESH), (2, NOT_READY, GONE)),
        {},
        True,
        held=2,
        policy=HeartbeatPolicy(POLICY.not_ready_after, POLICY.lost_after, DisruptionPolicy(min_nodes=2)),
    ),
    Case(
        "Lost nodes are out of the fleet: 3 silent of 5 left is disruption mode",
        fleet((2, READY, FRESH), (3, READY, SILENT), (5, LOST, GONE)),
        {NOT_READY: 3},
        True,
    ),
    Case(
        "nodes never heard from are not in the fleet",
        fleet((2, READY, FRESH), (1, READY, SILENT), (20, NOT_READY, None)),
        {NOT_READY: 1},
        False,
    ),
    Case(
        "a high rate judges several Lost in one cycle",
        fleet((9, READY, FRESH), (3, NOT_READY, GONE)),
        {LOST: 3},
        False,
        policy=HeartbeatPolicy(
            POLICY.not_ready_after, POLICY.lost_after, DisruptionPolicy(replace_rate=1000)
        ),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_fleet_is_judged_as_a_whole(case: Case) -> None:
    before = Liveness(tick=0.0, refilled=NOW - timedelta(seconds=1))
    judged = judge(case.nodes, NOW, 1.0, case.policy, before)
    moves: dict[NodeState, int] = {}
    for t in judged.transitions:
        moves[t.new] = moves.get(t.new, 0) + 1
    assert moves == case.moves
    assert (judged.disruption is not None) is case.disrupted
    assert len(judged.held) == case.held
    assert judged.stalled is None


def test_disruption_mode_says_how_many_of_how_many_since_when() -> None:
    nodes = fleet((4, READY, FRESH), (6, READY, SILENT))
    first = judge(nodes, NOW, 1.0, POLICY, Liveness(tick=0.0))
    assert first.disruption is not None
    assert (first.disruption.silent, first.disruption.fleet, first.disruption.since) == (6, 10, NOW)
    assert (
        first.disruption.message() == "6 of 10 nodes silent since 2026-12-07T12:00:00+00:00; not re-placing"
    )
    # Still on a cycle later: the mode's start is kept.
    later = NOW + timedelta(seconds=2)
    marked = [
        (n, NOT_READY if s is READY and last < NOW - POLICY.not_ready_after else s, last)
        for n, s, last in nodes
    ]
    again = judge(marked, later, 3.0, POLICY, first.liveness)
    assert again.disruption is not None and again.disruption.since == NOW
    assert again.transitions == ()


def test_a_disruption_past_the_lost_deadline_moves_nothing_then_judgement_resumes_from_its_end() -> None:
    # Six of ten silent for 10 minutes: all NotReady, none Lost.
    nodes = fleet((4, READY, FRESH), (6, NOT_READY, timedelta(minutes=10)))
    during = judge(nodes, NOW, 1.0, POLICY, Liveness(tick=0.0))
    assert during.disruption is not None and during.transitions == () and len(during.held) == 6
    # Four come back (their heartbeats made them Ready): 2 of 10 silent, the mode ends; the two
    # still silent are NOT judged Lost at once: their deadline counts from the mode's end.
    back = fleet((8, READY, FRESH), (2, NOT_READY, timedelta(minutes=10)))
    ended = judge(back, NOW, 2.0, POLICY, during.liveness)
    assert ended.disruption is None and ended.transitions == ()
    assert ended.liveness.grace_from == NOW
    # Past the Lost deadline counted from there, they are Lost (one per token).
    much_later = NOW + POLICY.lost_after + timedelta(seconds=1)
    back_later = [(n, s, much_later if s is READY else last) for n, s, last in back]
    resumed = judge(back_later, much_later, 400.0, POLICY, ended.liveness, interval=2.0)
    # 398 s between two cycles is a stall of the loop itself: it restarts the grace, nothing moves.
    assert resumed.stalled is not None and resumed.transitions == ()
    # With cycles every 2 s, the two are Lost once the deadline from the mode's end has passed.
    liveness = ended.liveness
    t, tick, losts = NOW, 2.0, []
    while t < much_later + timedelta(seconds=30):
        t += timedelta(seconds=2)
        tick += 2.0
        beats = [(n, s, t if s is READY else last) for n, s, last in back if n not in losts]
        cycle = judge(beats, t, tick, POLICY, liveness, interval=2.0)
        liveness = cycle.liveness
        assert cycle.stalled is None and cycle.disruption is None
        for change in cycle.transitions:
            assert change.new is LOST and t >= NOW + POLICY.lost_after
            losts.append(change.node)
    assert sorted(losts) == ["n08", "n09"]


def test_a_stall_of_the_loop_restarts_every_nodes_grace() -> None:
    # The server stopped for 80 s (twice the NotReady deadline): every heartbeat is 80 s old.
    nodes = fleet((200, READY, timedelta(seconds=80)))
    judged = judge(nodes, NOW, 81.0, POLICY, Liveness(tick=1.0), interval=1.0)
    assert judged.stalled == 80.0
    assert judged.transitions == () and judged.disruption is None
    assert judged.liveness.grace_from == NOW
    # Nodes that stay silent are judged from the stall's end: NotReady a deadline later, not before.
    liveness, marked = judged.liveness, 0
    for second in range(1, 41):
        cycle = judge(nodes, NOW + timedelta(seconds=second), 81.0 + second, POLICY, liveness, interval=1.0)
        liveness = cycle.liveness
        assert cycle.stalled is None
        marked += len(cycle.transitions)
        assert (marked == 200) is (second >= 40), second
    assert cycle.disruption is not None


def test_a_gap_is_a_stall_past_the_not_ready_deadline_and_two_intervals() -> None:
    assert stall_after(POLICY, 1.0) == 40.0
    assert stall_after(POLICY, 30.0) == 60.0
    nodes = fleet((3, READY, timedelta(seconds=30)))
    assert judge(nodes, NOW, 40.0, POLICY, Liveness(tick=0.0)).stalled is None
    assert judge(nodes, NOW, 40.5, POLICY, Liveness(tick=0.0)).stalled == 40.5
    # The first cycle has nothing to compare with.
    assert judge(nodes, NOW, 1e6, POLICY, Liveness()).stalled is None


def test_the_rate_limit_judges_the_longest_silent_first_and_refills_by_the_clock() -> None:
    nodes = [
        *fleet((20, READY, FRESH)),
        ("old", NOT_READY, NOW - timedelta(seconds=900)),
        ("older", NOT_READY, NOW - timedelta(seconds=1000)),
        ("oldest", NOT_READY, NOW - timedelta(seconds=1100)),
    ]
    first = judge(nodes, NOW, 1.0, POLICY, Liveness(tick=0.0))
    assert first.transitions == (Transition("oldest", NOT_READY, LOST),)
    assert first.held == ("old", "older")
    # 0.1 node/s: nothing more 5 s later, the next one 10 s after the first.
    rest = [(n, LOST if n == "oldest" else s, last) for n, s, last in nodes]
    five = judge(rest, NOW + timedelta(seconds=5), 6.0, POLICY, first.liveness)
    assert five.transitions == () and five.held == ("old", "older")
    ten = judge(rest, NOW + timedelta(seconds=10), 11.0, POLICY, five.liveness)
    assert ten.transitions == (Transition("older", NOT_READY, LOST),)


def test_a_ready_node_past_the_lost_deadline_without_a_token_is_marked_not_ready() -> None:
    nodes = fleet((20, READY, FRESH), (2, READY, GONE))
    judged = judge(nodes, NOW, 1.0, POLICY, Liveness(tick=0.0))
    assert sorted(t.new.value for t in judged.transitions) == ["Lost", "NotReady"]
    assert len(judged.held) == 1


@given(
    ready=st.integers(0, 30),
    silent=st.integers(0, 30),
    gone=st.integers(0, 30),
    lost=st.integers(0, 10),
)
def test_disruption_mode_never_judges_a_node_lost_and_never_revives_one(
    ready: int, silent: int, gone: int, lost: int
) -> None:
    nodes = fleet((ready, READY, FRESH), (silent, READY, SILENT), (gone, NOT_READY, GONE), (lost, LOST, GONE))
    judged = judge(nodes, NOW, 1.0, POLICY, Liveness(tick=0.0))
    heard = ready + silent + gone
    share = (silent + gone) / heard if heard else 0.0
    assert (judged.disruption is not None) is (silent + gone >= 3 and share >= 0.55)
    for t in judged.transitions:
        assert t.new is not READY and t.old is not LOST
        if judged.disruption is not None:
            assert t.new is NOT_READY
    # At most one Lost per token (the bucket holds one node at 0.1/s).
    assert sum(t.new is LOST for t in judged.transitions) <= 1
