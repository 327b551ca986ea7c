"""``fleetserve rollout status``'s line: what it says, and when it calls a rollout complete."""

from __future__ import annotations

from typing import Any

import pytest

from fleetserve.adminapi.fleet import DeploymentDetail
from fleetserve.cli.views import rollout_line


def view(generation: int = 2, seen: int = 2, revision: str = "b", **progress: Any) -> DeploymentDetail:
    rollout = {"revision": "b", "desired": 2, "updated": 2, "ready": 2, "old": 0, "draining": 0}
    rollout.update(progress)
    rollout["complete"] = rollout["old"] == 0 and rollout["updated"] == rollout["ready"] == 2
    return DeploymentDetail.model_validate(
        {
            "name": "chat",
            "model": "m",
            "profiles": [{"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}}],
            "replicas": [],
            "generation": generation,
            "revision": revision,
            "status": {
                "observedGeneration": seen,
                "rollout": rollout,
                "conditions": [
                    {
                        "type": "ReplicaFailure",
                        "status": True,
                        "reason": "ReplicaFailed",
                        "message": "chat-5 failed: 404",
                    }
                ]
                if progress.get("failing")
                else [],
            },
        }
    )


@pytest.mark.parametrize(
    ("case", "data", "words", "done"),
    [
        ("the reconciler has not seen the change yet", view(seen=1), "waiting for the reconciler", False),
        ("new replicas still starting", view(ready=1, old=1), "1 ready, 1 old", False),
        ("old replicas still draining", view(draining=1), "1 draining", False),
        ("a new replica failing", view(ready=1, old=1, failing=True), "chat-5 failed: 404", False),
        ("every replica at the new revision", view(), "rolled out: revision b", True),
        (
            "a model's new weights being rolled",
            view(ready=1, old=1, cause="model"),
            "rolling out revision b (the weights of model m changed): 2/2 updated",
            False,
        ),
        ("the deployment's own change", view(old=1, cause="deployment"), "b (the deployment changed)", False),
    ],
)
def test_the_rollout_line_says(case: str, data: DeploymentDetail, words: str, done: bool) -> None:
    line, complete = rollout_line(data)
    assert words in line, (case, line)
    assert complete is done, case
