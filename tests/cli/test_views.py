"""The node table's models column: cache downloads in progress and failures, from the agent's report;
and the enrolments that wait for an operator, below the table."""

from __future__ import annotations

import io
from datetime import UTC, datetime
from typing import Any

import pytest
from rich.console import Console

from fleetserve.adminapi.credentials import EnrolmentView
from fleetserve.adminapi.fleet import Explanation
from fleetserve.agent.runtime import STALL_SECONDS, download_message
from fleetserve.cli.views import downloads, engines, print_waiting_enrolments, waiting_enrolments
from fleetserve.inventory.approval import Hardware
from fleetserve.protocol import AgentStatus
from fleetserve.spec.resources import Node


def explained(deployment: str, generation: int, decision: dict[str, Any]) -> Explanation:
    """``GET /deployments/NAME/explain`` with this decision and no status."""
    return Explanation.model_validate(
        {
            "deployment": deployment,
            "generation": generation,
            "status": {},
            "decision": decision,
            "decidedAt": None,
        }
    )


def node(*items: dict[str, Any]) -> AgentStatus:
    """What a node's agent reported (``node.status.agent``): these downloads."""
    return AgentStatus.model_validate({"downloads": list(items)})


@pytest.mark.parametrize(
    ("items", "shown"),
    [
        ((), "-"),
        (({"model": "a", "state": "ready", "done": 5, "total": 5},), "1 ready"),
        (
            (
                {
                    "model": "big",
                    "state": "downloading",
                    "done": 3 * 2**30,
                    "total": 12 * 2**30,
                    "rate": 50 * 2**20,
                },
            ),
            "big 3.0GiB/12.0GiB 25% at 50.0MiB/s",
        ),
        (
            (
                {"model": "a", "state": "ready", "done": 5, "total": 5},
                {
                    "model": "g",
                    "state": "failed",
                    "done": 0,
                    "total": 9,
                    "error": "hf://org/g: org/g is gated",
                },
            ),
            "1 ready; g failed: hf://org/g: org/g is gated",
        ),
    ],
    ids=["nothing reported", "a ready model", "a download in progress", "a failed download with its error"],
)
def test_the_models_column_shows_progress_and_the_last_error(
    items: tuple[dict[str, Any], ...], shown: str
) -> None:
    assert downloads(node(*items)) == shown


def test_a_download_without_bytes_for_a_minute_is_called_stalled_with_its_source() -> None:
    moving = download_message("m", "hf://org/m/m.gguf", 2**20, 2**21, 2**19, idle=1.0)
    assert moving == "downloading model m from hf://org/m/m.gguf: 1.0MiB of 2.0MiB at 512.0KiB/s"
    stalled = download_message("m", "hf://org/m/m.gguf", 2**20, 2**21, 0.0, idle=STALL_SECONDS + 15)
    assert stalled.startswith("download of model m from hf://org/m/m.gguf stalled: no bytes for 75 s")


def test_a_stored_decision_says_how_many_unplaced_replicas_it_does_not_explain() -> None:
    from rich.console import Console

    from fleetserve.cli.views import print_decision

    report = {"message": "profile gpu: 0/1 nodes fit"}
    decision = {
        "unplaced": [{"replica": f"huge-{i}", "reports": [report]} for i in range(2)],
        "unplacedTotal": 30,
    }
    console = Console(record=True, width=200)
    print_decision(explained("huge", 1, decision), console)
    text = console.export_text()
    assert "huge-1 unschedulable" in text
    assert "… and 28 more unschedulable (the record explains the first 2)" in text
    # A record of before the bound, or one under it, says nothing more.
    console = Console(record=True, width=200)
    print_decision(explained("huge", 1, {"unplaced": decision["unplaced"]}), console)
    assert "more unschedulable" not in console.export_text()


def enrolment(node: str, approved: bool = False, requested: str | None = None) -> EnrolmentView:
    """One row of the admin API's ``/api/v1/enrolments``."""
    return EnrolmentView.model_validate(
        {
            "node": node,
            "enrolled": True,
            "issuedAt": "2026-12-06T04:00:00+00:00",
            "approved": approved,
            "requestedAt": requested,
            "requestedFrom": "10.0.0.7" if requested else None,
        }
    )


@pytest.mark.parametrize(
    ("since", "waiting"),
    [
        (None, ["b"]),
        (datetime(2026, 12, 6, 4, 30, tzinfo=UTC), ["b"]),
        (datetime(2026, 12, 6, 5, 0, tzinfo=UTC), []),
    ],
    ids=["any time", "a request since then waits", "a request before then is not this run's"],
)
def test_an_enrolment_waits_while_it_was_requested_and_not_approved(
    since: datetime | None, waiting: list[str]
) -> None:
    enrolments = [
        enrolment("a"),  # enrolled, nothing asked since
        enrolment("b", requested="2026-12-06T04:45:00+00:00"),
        enrolment("c", approved=True, requested="2026-12-06T04:45:00+00:00"),  # approved: the next goes
    ]
    assert waiting_enrolments(enrolments, since) == waiting


def test_get_nodes_names_a_waiting_enrolment_and_the_command_that_approves_it() -> None:
    console = Console(file=io.StringIO(), width=250)
    print_waiting_enrolments([enrolment("a"), enrolment("b", requested="2026-12-06T04:45:00+00:00")], console)
    shown = console.file.getvalue()  # type: ignore[attr-defined]
    assert shown == (
        "node b: an enrolment from 10.0.0.7 at 2026-12-06T04:45:00+00:00 waits for approval: "
        "fleetserve nodes approve b\n"
    )


def test_get_nodes_names_a_held_hardware_claim_beside_the_approved_hardware() -> None:
    held = enrolment("real").model_copy(
        update={
            "approved_hardware": Hardware(cores=2, memory=8 << 30),
            "claimed_hardware": Hardware(cores=1000, memory=8 << 30),
        }
    )
    console = Console(file=io.StringIO(), width=250)
    print_waiting_enrolments([enrolment("a"), held], console)
    assert console.file.getvalue() == (  # type: ignore[attr-defined]
        "node real: claims 1000 cores, 8.0GiB, more than approved (2 cores, 8.0GiB); placed with the "
        "approved hardware until: fleetserve nodes approve real\n"
    )


@pytest.mark.parametrize(
    ("reported", "shown"),
    [
        pytest.param(None, "?", id="never-reported-is-a-question-mark"),
        pytest.param([], "none", id="an-agent-that-found-no-engine-says-none"),
        pytest.param(
            [
                {"engine": "llama.cpp", "version": "b1", "variants": ["cpu", "cuda"]},
                {"engine": "vllm", "version": "0.32.0", "variants": []},
            ],
            "llama.cpp cpu,cuda; vllm -",
            id="each-build-with-the-variants-it-runs",
        ),
    ],
)
def test_the_engines_column_shows_what_the_nodes_agent_found(reported: Any, shown: str) -> None:
    doc: dict[str, Any] = {"name": "n", "cpu": {"cores": 1, "memory": "1GiB"}}
    if reported is not None:
        doc["engines"] = reported
    assert engines(Node.model_validate(doc)) == shown
