"""The node table's models column: cache downloads in progress and failures, from the agent's report."""

from __future__ import annotations

from typing import Any

import pytest

from fleetserve.adminapi.fleet import Explanation
from fleetserve.agent.runtime import STALL_SECONDS, download_message
from fleetserve.cli.views import downloads
from fleetserve.protocol import AgentStatus


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
