"""The multi-host lab (tests/lab/lab.py): hosts in network namespaces, each with a real agent on
its own address and real llama-servers, the server on the bridge. Each scenario runs under
gateway load and prints its figures (requests sent / completed / failed / truncated,
non-streamed and streamed apart; time to recover; time to fence).

Skipped, with the reason, where the machine cannot make network namespaces (not root).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import scenarios
from scenarios import Result

from lab import Lab, unavailable

REASON = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

# A request in flight to a host when its link is cut never gets an answer: the client's timeout
# fails it. Those are the only failures a partition may cost (one per non-streamed client).
IN_FLIGHT = scenarios.PARTITION_CLIENTS
# The gateway's connect timeout is 5 s: a request that took this long after a fault paid one.
PAID_A_CONNECT_TIMEOUT = 4.0
# The gateway re-reads its routes every second.
ROUTE_REFRESH = 1.5


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    built = scenarios.start(tmp_path_factory.mktemp("lab"))
    try:
        yield built
    finally:
        built.close()


def report(result: Result, capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        print(
            f"\n  {result.name}: requests {result.requests.summary()}; streams {result.streams.summary()}; "
            f"slowest request {result.timing.slowest:.2f} s; "
            f"recovered {result.recovered and round(result.recovered, 1)} s; "
            f"fenced {result.fenced and round(result.fenced, 1)} s; "
            f"engines per replica at most {result.max_engines_per_replica}; {'; '.join(result.notes)}"
            + (
                f"; served after heal {result.served_after_heal}"
                if result.served_after_heal is not None
                else ""
            )
        )


# A released replica's engine stops at its agent's next look at its assignments (about a second in
# the lab) plus the engine's graceful stop (SIGTERM, SIGKILL after the supervisor's 10 s grace):
# a scenario that ends the moment the store lets a replica go may still see its engine for that long.
STRAY_STOPS_WITHIN = 20.0


def no_orphans(lab: Lab) -> None:
    """Every live engine of the lab serves a replica the store lists, or stops within
    ``STRAY_STOPS_WITHIN`` seconds: an engine that outlives that is leaked."""
    deadline = time.monotonic() + STRAY_STOPS_WITHIN
    while True:
        listed = {r["name"] for r in lab.replicas(scenarios.MODEL)}
        strays = {pid: name for pid, name in lab.engines().items() if name not in listed}
        if not strays or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert not strays, f"engines of replicas no longer listed, alive {STRAY_STOPS_WITHIN:.0f} s on: {strays}"


def test_an_engine_killed_with_sigkill_is_restarted_and_no_request_fails(lab, capsys):
    result = scenarios.kill_engine(lab)
    report(result, capsys)
    assert result.requests.sent > 0 and result.recovered is not None
    assert (result.requests.failed, result.requests.truncated) == (0, 0), result.requests.errors
    assert result.max_engines_per_replica == 1
    no_orphans(lab)


def test_an_agent_killed_with_sigkill_takes_its_engines_along_and_no_request_fails(lab, capsys):
    result = scenarios.kill_agent(lab)
    report(result, capsys)
    assert result.requests.sent > 0 and result.recovered is not None
    assert (result.requests.failed, result.requests.truncated) == (0, 0), result.requests.errors
    assert result.max_engines_per_replica == 1
    no_orphans(lab)


def test_a_partitioned_host_is_replaced_after_the_deadline_and_fenced_on_heal(lab, capsys):
    result = scenarios.partition(lab)
    report(result, capsys)
    assert result.recovered is not None and result.fenced is not None
    assert result.requests.truncated == 0, result.requests.errors
    assert result.requests.failed <= IN_FLIGHT, result.requests.errors
    # Health-aware routing: requests sent in the first moments after the cut may wait out a connect
    # timeout on the silent host (until one failure ejects it), but none sent once it is NotReady
    # and the routes were refreshed: it is out of the routes long before it is Lost.
    paid = [s for s in result.timing.slow if s[0] >= result.fault_at and s[1] >= PAID_A_CONNECT_TIMEOUT]
    assert len(paid) <= scenarios.PARTITION_CLIENTS, f"requests that waited on the silent host: {paid}"
    assert result.not_ready_at is not None
    late = [s for s in paid if s[0] >= result.not_ready_at + ROUTE_REFRESH]
    assert not late, f"requests sent to the host after it was NotReady (and routes refreshed): {late}"
    assert result.max_engines_per_replica == 1, "two engines served one replica at once"
    assert result.served_after_heal == 0, "the old engine took requests after the heal, before it was fenced"
    no_orphans(lab)


def test_most_hosts_cut_at_once_are_marked_not_ready_but_nothing_is_re_placed(lab, capsys):
    """Disruption mode (``reconcile/disruption.py``); the test above is its other half: a single
    cut host is still re-placed after the Lost deadline."""
    result = scenarios.partition_most(lab)
    report(result, capsys)
    assert result.recovered is not None and result.not_ready_at is not None
    no_orphans(lab)


def test_a_drained_host_hands_its_replicas_over_without_failing_a_request(lab, capsys):
    result = scenarios.drain(lab)
    report(result, capsys)
    assert result.recovered is not None
    assert (result.requests.failed, result.requests.truncated) == (0, 0), result.requests.errors
    assert result.max_engines_per_replica == 1
    no_orphans(lab)


@pytest.mark.skipif(
    not scenarios.rollout_available(), reason="rolling updates (fleetserve rollout) not in this build"
)
def test_a_rolling_update_replaces_every_replica_without_failing_a_request(lab, capsys):
    result = scenarios.roll(lab)
    report(result, capsys)
    assert result.recovered is not None
    assert (result.requests.failed, result.requests.truncated) == (0, 0), result.requests.errors
    assert result.max_engines_per_replica == 1
    no_orphans(lab)
