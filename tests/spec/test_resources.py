"""Which of a Model's fields are its weights: a change of one is a new revision of every deployment
serving the model (a rollout); a change of any other rolls nothing."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from builders import deployment
from fleetserve.spec.resources import ALTERNATE_WEIGHT_FIELDS, WEIGHT_FIELDS, Model, Weights, revision_parts

SHA_A = "a" * 64
SHA_B = "b" * 64
BASE: dict[str, Any] = {
    "name": "m",
    "source": "hf://org/repo/m.gguf",
    "size": "1GiB",
    "sha256": SHA_A,
    "alternates": [{"format": "safetensors", "source": "hf://org/repo-st", "size": "2GiB", "sha256": SHA_B}],
}
ARCH = {"layers": 2, "kvHeads": 2, "headDim": 64}


def alternate(**change: Any) -> list[dict[str, Any]]:
    return [{**BASE["alternates"][0], **change}]


@pytest.mark.parametrize(
    ("change", "rolls"),
    [
        ({"source": "hf://org/repo/m-q8.gguf"}, True),
        ({"source": "hf://org/repo/m.gguf@0123abcd"}, True),  # a source's revision is its source
        ({"sha256": SHA_B}, True),
        ({"sha256": None}, True),
        ({"format": "safetensors", "alternates": []}, True),
        ({"alternates": []}, True),
        ({"alternates": alternate(source="hf://org/other-st")}, True),
        ({"alternates": alternate(sha256=SHA_A)}, True),
        ({"size": "3GiB"}, False),
        ({"architecture": ARCH}, False),
        ({"alternates": alternate(size="9GiB")}, False),
        ({"alternates": alternate(architecture=ARCH)}, False),
        ({}, False),
    ],
    ids=lambda v: str(v),
)
def test_a_model_change_is_a_new_revision_exactly_when_it_changes_the_weights(
    change: dict[str, Any], rolls: bool
) -> None:
    before, after = Model.model_validate(BASE), Model.model_validate({**BASE, **change})
    dep = deployment("d", 1, {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}}, model="m")
    old = dep.template_revision(before.weights_digest())
    new = dep.template_revision(after.weights_digest())
    assert (old != new) is rolls
    assert revision_parts(old)[0] == revision_parts(new)[0], "the deployment's own part is the same"


def test_the_weight_fields_are_fields_of_the_documents() -> None:
    assert set(WEIGHT_FIELDS) <= set(Model.model_fields)
    assert set(ALTERNATE_WEIGHT_FIELDS) <= set(Weights.model_fields)


def test_a_revision_without_weights_is_the_digest_a_server_before_them_gave() -> None:
    """The template part is computed as before the weights counted: replicas placed by an older
    server carry exactly it (``reconcile.lifecycle`` keeps and stamps them, rolls nothing)."""
    dep = deployment("d", 1, {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}}, model="m")
    # The formula of the servers before the weights counted, frozen here.
    spec = dep.model_dump(mode="json", by_alias=True, include={"model", "profiles"})
    assert (
        dep.template_revision() == hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    )
    assert dep.template_revision("abcd1234") == f"{dep.template_revision()}.abcd1234"
    assert revision_parts(dep.template_revision()) == (dep.template_revision(), "")
