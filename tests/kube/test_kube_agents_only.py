"""The Kubernetes backend refuses what only agents can serve (Apple Silicon: no DRA driver), by the
driver table's ``kube_supported``, naming the profile or class and the fix."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fleetserve.drivers import DRIVERS, Driver
from fleetserve.errors import ConfigError
from fleetserve.kube.cluster import render_cluster
from fleetserve.kube.pods import image_keys
from fleetserve.kube.stack import compose
from fleetserve.spec.cluster import Cluster
from fleetserve.spec.loader import Documents, load_files
from fleetserve.spec.resources import Deployment

EXAMPLE = Path(__file__).resolve().parents[2] / "examples/mac-studio"
FIX = "serve it through agents instead (`fleetserve agent` on the machine"


def mac_studio() -> Documents:
    return load_files([EXAMPLE / "fleet.yaml", EXAMPLE / "deployments.yaml"])


def only_cpu_profile(docs: Documents) -> Documents:
    """The same documents with the deployment's Metal profile left out."""
    deployments = [
        Deployment.model_validate(
            {
                **d.model_dump(by_alias=True),
                "profiles": [p.model_dump(by_alias=True) for p in d.profiles if p.device_class is None],
            }
        )
        for d in docs.deployments
    ]
    return dataclasses.replace(docs, deployments=deployments)


def test_a_deployment_with_a_metal_profile_is_refused_naming_the_profile_and_the_fix() -> None:
    with pytest.raises(ConfigError) as err:
        render_cluster(mac_studio(), Cluster(name="c", classes=("cpu",)))
    (problem,) = err.value.problems
    assert (problem.location, problem.field) == ("Deployment llama-70b", "profiles.mac-metal")
    assert problem.message.startswith(
        "profile mac-metal uses class apple-m2-ultra, whose driver gpu.apple.com has no DRA driver or "
        "device plugin, so Kubernetes cannot give a pod its devices; "
    )
    assert FIX in problem.message


def test_a_cluster_listing_an_apple_class_is_refused_naming_the_class() -> None:
    docs = only_cpu_profile(mac_studio())
    cluster = Cluster(name="c", classes=("apple-m2-ultra", "cpu"))
    for attempt in (
        lambda: compose(cluster, {c.name: c for c in docs.classes}),
        lambda: render_cluster(docs, cluster),
    ):
        with pytest.raises(ConfigError) as err:
            attempt()
        (problem,) = err.value.problems
        assert (problem.location, problem.field) == ("Cluster c", "classes[0]")
        assert problem.message.startswith("class apple-m2-ultra: driver gpu.apple.com has no DRA driver")
        assert FIX in problem.message


def test_both_refusals_come_in_one_answer() -> None:
    with pytest.raises(ConfigError) as err:
        render_cluster(mac_studio(), Cluster(name="c", classes=("apple-m2-ultra", "cpu")))
    assert [(p.location, p.field) for p in err.value.problems] == [
        ("Cluster c", "classes[0]"),
        ("Deployment llama-70b", "profiles.mac-metal"),
    ]


def test_without_the_metal_profile_the_same_documents_render_on_the_cpu_pool() -> None:
    result = render_cluster(only_cpu_profile(mac_studio()), Cluster(name="c", classes=("cpu",)))
    assert result.rendered == ("llama-70b-0",)
    (placed,) = result.decisions[0].placed
    assert [s.node for s in placed.replica.shards] == ["cpu-server"]


def test_no_image_key_is_offered_for_a_variant_kubernetes_cannot_serve() -> None:
    assert "llama.cpp/metal" not in image_keys()
    assert "llama.cpp/vulkan" in image_keys()
    assert [d for d, spec in DRIVERS.items() if not spec.kube_supported] == [Driver.APPLE]
