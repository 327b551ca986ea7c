"""The driver table is the single source of per-driver facts; label and taint follow one rule."""

from __future__ import annotations

import pytest

from fleetserve.drivers import (
    DRIVERS,
    Driver,
    RuntimeVariant,
    kube_drivers,
    metrics_exporters,
    parse_driver,
    pool_label,
    pool_taint,
    stack_for,
)
from fleetserve.engines.registry import ENGINES, serving_drivers
from fleetserve.engines.spec import EngineKind


@pytest.mark.parametrize(
    ("driver", "role", "env"),
    [
        (Driver.NVIDIA, "nvidia-gpu", {RuntimeVariant.CUDA: ("CUDA_VISIBLE_DEVICES",)}),
        (
            Driver.AMD,
            "amd-gpu",
            {
                RuntimeVariant.ROCM: ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"),
                RuntimeVariant.VULKAN: ("GGML_VK_VISIBLE_DEVICES",),
            },
        ),
        (Driver.APPLE, "apple-gpu", {RuntimeVariant.METAL: ()}),
        (Driver.CPU, "cpu", {RuntimeVariant.CPU: ()}),
    ],
)
def test_each_driver_row_holds_its_pool_role_and_visible_devices_variables(driver, role, env):
    spec = DRIVERS[driver]
    assert spec.pool_role == role
    assert dict(spec.visible_devices_env) == env


def test_pool_label_and_taint_are_derived_from_the_driver_name_by_one_rule():
    for driver, spec in DRIVERS.items():
        assert pool_label(driver) == ("fleetserve.io/pool", spec.pool_role)
        taint = pool_taint(driver)
        assert taint.key == f"fleetserve.io/{driver.value}"
        assert taint.effect == "NoSchedule"
    taints = {pool_taint(d).key for d in Driver}
    assert len(taints) == len(Driver), "every driver gets its own taint"


def test_every_runtime_variant_an_engine_offers_has_a_visible_devices_row():
    for caps in ENGINES.values():
        for variant, driver in caps.variants.items():
            assert variant in DRIVERS[driver].visible_devices_env
            # Kubernetes can give a pod the devices of every driver but those served by agents only.
            assert (variant in DRIVERS[driver].device_plugin_resource) == DRIVERS[driver].kube_supported


def test_apple_silicon_is_an_accelerator_row_served_by_agents_only():
    spec = DRIVERS[Driver.APPLE]
    assert (spec.is_accelerator, spec.kube_supported, spec.stack_components) == (True, False, ())
    assert spec.resource_slice is None and dict(spec.device_plugin_resource) == {}
    assert spec.metrics_exporter is None, "no exporter exists: the agent reads ioreg itself"
    assert kube_drivers() == frozenset(Driver) - {Driver.APPLE}
    assert pool_label(Driver.APPLE) == ("fleetserve.io/pool", "apple-gpu")
    assert str(pool_taint(Driver.APPLE)) == "fleetserve.io/gpu.apple.com=present:NoSchedule"
    assert ENGINES[EngineKind.LLAMACPP].variants[RuntimeVariant.METAL] is Driver.APPLE
    assert RuntimeVariant.METAL not in ENGINES[EngineKind.VLLM].variants


def test_stack_composition_drops_the_drivers_not_claimed():
    stack = stack_for([Driver.NVIDIA, Driver.CPU])
    assert "nvidia-dra-driver-gpu" in stack
    assert "dra-driver-cpu" in stack
    assert not any(c.startswith("amd") for c in stack)
    assert stack_for([]) == (), "an absent list of drivers is empty, never everything"


def test_a_driver_name_outside_the_table_parses_to_none():
    assert parse_driver("gpu.nvidia.com") is Driver.NVIDIA
    assert parse_driver("gaudi.intel.com") is None


def test_every_driver_in_the_table_is_served_by_some_engine():
    assert serving_drivers() == frozenset(Driver)


def test_each_gpu_drivers_row_names_its_metrics_exporter_by_labels_and_named_port():
    nvidia = DRIVERS[Driver.NVIDIA].metrics_exporter
    amd = DRIVERS[Driver.AMD].metrics_exporter
    assert nvidia is not None and amd is not None
    assert nvidia.pod_selectors == ("app=nvidia-dcgm-exporter", "app.kubernetes.io/name=dcgm-exporter")
    assert (nvidia.port_name, nvidia.default_port, nvidia.path) == ("metrics", 9400, "/metrics")
    assert amd.pod_selectors == ("app.kubernetes.io/name=metrics-exporter",)
    assert (amd.port_name, amd.default_port, amd.path) == ("exporter-port", 5000, "/metrics")
    assert DRIVERS[Driver.CPU].metrics_exporter is None
    assert list(metrics_exporters()) == [Driver.NVIDIA, Driver.AMD]
    for driver, exporter in metrics_exporters().items():
        assert exporter.name in DRIVERS[driver].stack_components, "the exporter is a component of its stack"
