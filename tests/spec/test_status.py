"""A deployment's status and its decisions are typed, yet stored and served as the JSON they were
before: only the fields that were set, unknown fields kept, read back unchanged."""

from __future__ import annotations

from typing import Any

import pytest

from fleetserve.spec.status import DecisionRecord, DeploymentStatus, StatusCondition

ROWS: list[tuple[str, dict[str, Any]]] = [
    ("never reconciled", {}),
    ("a row of before rollouts (no rollout, no autoscaler)", {"observedGeneration": 3, "replicas": ["a-0"]}),
    (
        "a full status",
        {
            "failures": {},
            "rollout": {"revision": "b", "desired": 1, "updated": 1, "ready": 1, "old": 0, "draining": 0,
                        "complete": True},
            "previousRevision": None,
            "autoscaler": [{"deployment": "a", "at": 5.0, "desired": 2, "changed": True, "repeats": 1,
                            "last_at": 5.0}],
            "observedGeneration": 2,
            "conditions": [{"type": "Accepted", "status": True, "reason": "Accepted", "message": ""}],
            "desiredReplicas": 1,
            "replicas": ["a-3"],
            "unschedulable": 0,
        },
    ),
    ("a field this version does not know", {"observedGeneration": 1, "futureField": {"x": [1]}}),
]  # fmt: skip


@pytest.mark.parametrize(("case", "row"), ROWS, ids=[c for c, _ in ROWS])
def test_a_stored_status_reads_back_as_the_same_json(case: str, row: dict[str, Any]) -> None:
    status = DeploymentStatus.model_validate(row)
    assert status.stored() == row, case
    assert dict(status) == row and status == row, "it reads as its JSON, as the untyped store's did"


def test_a_status_answers_by_attribute_with_defaults_for_what_it_lacks() -> None:
    status = DeploymentStatus.model_validate({"conditions": [{"type": "Scheduled", "status": False}]})
    assert status.rollout.revision == "" and status.failures.count == 0 and status.replicas == []
    assert status.condition("Scheduled") == StatusCondition(type="Scheduled", status=False)
    assert status.condition("Accepted") is None


def test_a_decision_keeps_its_unplaced_total_and_the_placed_shards() -> None:
    row = {
        "deployment": "chat",
        "placed": [{"replica": "chat-0", "profile": "gpu", "shards": [{"node": "n1", "devices": [0, 1]}]}],
        "unplaced": [{"replica": "chat-1", "reports": [{"message": "0/1 nodes fit"}]}],
        "unplacedTotal": 40,
    }
    record = DecisionRecord.model_validate(row)
    assert record.unplaced_total == 40 and record.placed[0].shards[0].devices == (0, 1)
    assert record.unplaced[0].reports[0].message == "0/1 nodes fit"
    assert record.stored() == row
