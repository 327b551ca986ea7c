"""A model's alternate weights: one Model, its weights in several formats, each engine serving the
first copy it loads (``engines.registry.weights_for``) — in the document's rules, the facts
placement measures, the refusals at apply, the agent's assignment and the Kubernetes render."""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from builders import cpu_8c_32g, node
from builders import deployment as build_deployment
from fleetserve.agent.runtime import served
from fleetserve.dev.tinymodel import write_tiny_model
from fleetserve.drivers import Driver, RuntimeVariant
from fleetserve.engines.registry import ENGINES, weights_for
from fleetserve.engines.spec import EngineKind
from fleetserve.errors import ConfigError
from fleetserve.fleet import check_documents, snapshot_from
from fleetserve.gguf_facts import model_facts, read_gguf_facts
from fleetserve.kube.cluster import render_cluster
from fleetserve.placement.demand import CPU_RUNTIME_OVERHEAD
from fleetserve.placement.placer import SearchKind, plan
from fleetserve.protocol import Assignment
from fleetserve.server.admin.apply import apply_batch
from fleetserve.spec.loader import Documents, load_text
from fleetserve.spec.resources import MAX_ALTERNATES, Model, ModelFormat, Replica, Shard, Weights
from fleetserve.store.sql import SqlStore

GB = 10**9

# The GGUF for llama.cpp first, the same model as safetensors for vLLM beside it.
TINY: dict[str, Any] = {
    "kind": "Model",
    "name": "tiny",
    "source": "hf://org/tiny-gguf/tiny.gguf",
    "format": "gguf",
    "size": "1GB",
    "alternates": [{"format": "safetensors", "source": "hf://org/tiny", "size": "3GB"}],
}
MIXED_PROFILES = (
    {"name": "llama", "engine": "llama.cpp", "cpu": {"cores": 8}},
    {"name": "vllm", "engine": "vllm", "runtime": "cpu", "cpu": {"cores": 4}},
)


def model(doc: dict[str, Any] = TINY, **fields: Any) -> Model:
    return Model.model_validate({**doc, **fields})


def problems(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, message) of every problem loading ``doc`` as YAML would."""
    with pytest.raises(ConfigError) as err:
        load_text(json.dumps(doc))
    return [(p.field, p.message) for p in err.value.problems]


# --- the document ----------------------------------------------------------------------------------


def test_the_weights_are_the_primary_then_each_alternate_named_as_they_are_cached() -> None:
    primary, alternate = model().weights()
    assert (primary.name, primary.format, primary.source, primary.size) == (
        "tiny", ModelFormat.GGUF, "hf://org/tiny-gguf/tiny.gguf", GB
    )  # fmt: skip
    assert (alternate.name, alternate.format, alternate.source, alternate.size) == (
        "tiny.safetensors", ModelFormat.SAFETENSORS, "hf://org/tiny", 3 * GB
    )  # fmt: skip
    assert primary.alternates == () and alternate.alternates == ()
    assert Model.weights_field(0, "size") == "size"
    assert Model.weights_field(1, "source") == "alternates[0].source"


def test_an_alternate_in_the_primarys_format_is_refused_naming_its_field() -> None:
    doc = {**TINY, "alternates": [{"format": "gguf", "source": "/models/other.gguf"}]}
    [(field, message)] = problems(doc)
    assert field == "alternates[0].format"
    assert "already has gguf weights" in message


def test_two_alternates_of_one_format_are_refused_naming_the_second() -> None:
    alt = {"format": "safetensors", "source": "hf://org/tiny"}
    [(field, _)] = problems({**TINY, "alternates": [alt, alt]})
    assert field == "alternates[1].format"


def test_the_list_of_alternates_is_bounded() -> None:
    alts = [{"format": "safetensors", "source": f"hf://org/t{i}"} for i in range(MAX_ALTERNATES + 1)]
    fields = [f for f, _ in problems({**TINY, "alternates": alts})]
    assert fields == ["alternates"]


@pytest.mark.parametrize(
    ("alternate", "field"),
    [
        ({"format": "safetensors", "source": "hf://org/t", "sha256": "ABC"}, "alternates[0].sha256"),
        ({"format": "safetensors", "source": ""}, "alternates[0].source"),
        ({"format": "safetensors"}, "alternates[0].source"),
        ({"format": "onnx", "source": "hf://org/t"}, "alternates[0].format"),
        ({"format": "safetensors", "source": "hf://org/t", "size": "-1GB"}, "alternates[0].size"),
        ({"format": "safetensors", "source": "hf://org/t", "name": "x"}, "alternates[0].name"),
    ],
)
def test_an_alternates_fields_obey_the_models_own_rules(alternate: dict[str, Any], field: str) -> None:
    fields = [f for f, _ in problems({**TINY, "alternates": [alternate]})]
    assert field in fields, fields


def test_a_name_too_long_to_cache_its_alternates_under_is_refused() -> None:
    longest = "m" * (63 - len(".safetensors"))
    assert model(name=longest).weights()[1].name == f"{longest}.safetensors"
    [(field, message)] = problems({**TINY, "name": longest + "m"})
    assert field == "name" and "at most 51 characters" in message
    # Without alternates the name keeps every one of its 63 characters.
    assert model({**TINY, "alternates": []}, name="m" * 63).name == "m" * 63


def test_an_old_document_loads_and_a_model_without_alternates_serialises_as_before() -> None:
    old = {"kind": "Model", "name": "m", "source": "/models/m.gguf", "format": "gguf", "size": 1000}
    loaded = Model.model_validate(old)
    assert loaded.alternates == ()
    assert "alternates" not in loaded.model_dump(mode="json", by_alias=True)
    assert json.loads(loaded.model_dump_json(by_alias=True, exclude_none=True)) == old
    assert model().model_dump(mode="json", by_alias=True)["alternates"] == [
        {
            "format": "safetensors",
            "source": "hf://org/tiny",
            "size": 3 * GB,
            "sha256": None,
            "architecture": None,
        }
    ]


def test_the_store_keeps_alternates_and_old_rows_stay_unchanged(sqlite_store: SqlStore) -> None:
    old = {"kind": "Model", "name": "old", "source": "/models/m.gguf", "format": "gguf", "size": "1GB"}
    first = apply_batch([old, TINY], sqlite_store)
    assert [(a.name, a.result) for a in first] == [("old", "created"), ("tiny", "created")]
    assert sqlite_store.get_model("tiny") == model()
    assert sqlite_store.get_model("old").alternates == ()
    again = apply_batch([old, TINY], sqlite_store)
    assert [a.result for a in again] == ["unchanged", "unchanged"]


# --- the choice --------------------------------------------------------------------------------------


def test_each_engine_serves_the_first_weights_it_loads() -> None:
    llama, vllm = weights_for(model(), EngineKind.LLAMACPP), weights_for(model(), EngineKind.VLLM)
    assert llama is not None and vllm is not None
    assert (llama.name, llama.source, llama.format) == (
        "tiny",
        "hf://org/tiny-gguf/tiny.gguf",
        ModelFormat.GGUF,
    )
    assert (vllm.name, vllm.source, vllm.format) == (
        "tiny.safetensors",
        "hf://org/tiny",
        ModelFormat.SAFETENSORS,
    )
    # Without the alternate, vLLM has nothing to serve; a model without alternates serves as itself.
    gguf_only = model({**TINY, "alternates": []})
    assert weights_for(gguf_only, EngineKind.VLLM) is None
    assert weights_for(gguf_only, EngineKind.LLAMACPP) == gguf_only


weights_docs = st.lists(
    st.sampled_from(list(ModelFormat)), min_size=1, max_size=len(ModelFormat), unique=True
).map(
    lambda formats: Model(
        name="m",
        source=f"/models/m.{formats[0].value}",
        format=formats[0],
        alternates=tuple(
            Weights(format=f, source=f"hf://org/m-{f.value}", size=i + 1) for i, f in enumerate(formats[1:])
        ),
    )
)


@given(weights_docs, st.sampled_from(list(EngineKind)))
def test_the_choice_is_the_first_loadable_copy_in_document_order(doc: Model, engine: EngineKind) -> None:
    chosen = weights_for(doc, engine)
    order = [doc.format, *(a.format for a in doc.alternates)]
    loadable = [i for i, f in enumerate(order) if f in ENGINES[engine].formats]
    if not loadable:
        assert chosen is None
        return
    assert chosen == doc.weights()[loadable[0]]
    assert chosen.format in ENGINES[engine].formats and chosen.alternates == ()
    assert (chosen.name == doc.name) == (loadable[0] == 0)
    # Idempotent: the weights choose themselves (the agent applies it to what the server chose).
    assert weights_for(chosen, engine) == chosen


def test_every_engine_loads_some_format() -> None:
    assert all(spec.formats for spec in ENGINES.values())


# --- facts and placement ---------------------------------------------------------------------------


def test_each_engine_is_measured_by_the_weights_it_serves(tmp_path: Path) -> None:
    gguf = write_tiny_model(tmp_path / "tiny.gguf")
    doc = model(
        source=str(gguf),
        size=None,
        alternates=[
            {
                "format": "safetensors",
                "source": "hf://org/tiny",
                "size": "2MB",
                "architecture": {"layers": 2, "kvHeads": 2, "headDim": 64, "contextLength": 256},
            }
        ],
    )
    facts = model_facts(doc)
    llama, vllm = facts.for_engine(EngineKind.LLAMACPP), facts.for_engine(EngineKind.VLLM)
    assert llama == facts and llama.weight_bytes == read_gguf_facts(gguf, "tiny").weight_bytes
    assert vllm is not None
    assert (vllm.name, vllm.weight_bytes, vllm.kv_bytes_per_token) == (
        "tiny.safetensors",
        2 * 10**6,
        2 * 2 * 2 * 64 * 2,
    )
    assert model_facts(model({**TINY, "alternates": []})).for_engine(EngineKind.VLLM) is None


def test_a_broken_alternate_is_refused_naming_its_field() -> None:
    doc = model(alternates=[{"format": "safetensors", "source": "hf://org/tiny"}])  # no size
    with pytest.raises(ConfigError) as err:
        model_facts(doc)
    [problem] = err.value.problems
    assert (problem.location, problem.field) == ("Model tiny", "alternates[0].size")


def documents(
    *profiles: dict[str, Any], doc: dict[str, Any] = TINY, nodes: tuple[Any, ...] = ()
) -> Documents:
    dep = build_deployment("tiny", 2, *(profiles or MIXED_PROFILES), model="tiny")
    return Documents(
        nodes=list(nodes or (cpu_8c_32g("a"), node("b", 4, "32Gi"))),
        models=[Model.model_validate(doc)],
        deployments=[dep],
    )


def test_a_vllm_replica_is_placed_for_the_safetensors_size_and_a_llamacpp_one_for_the_gguf() -> None:
    # Profiles in order: llama.cpp takes the 8-core node; the second replica fits only vLLM's 4 cores.
    [decision] = plan(documents().deployments, snapshot_from(documents()))
    by_profile = {p.replica.profile: p.replica.shards[0] for p in decision.placed}
    assert set(by_profile) == {"llama", "vllm"}, decision
    assert (by_profile["llama"].node, by_profile["llama"].memory) == ("a", GB + CPU_RUNTIME_OVERHEAD)
    assert (by_profile["vllm"].node, by_profile["vllm"].memory) == ("b", 3 * GB + CPU_RUNTIME_OVERHEAD)


@pytest.mark.parametrize("search", list(SearchKind))
@pytest.mark.parametrize(("cached", "first"), [("tiny.safetensors", "b"), ("tiny", "a")])
def test_the_cache_tie_break_looks_for_the_weights_the_engine_serves(
    search: SearchKind, cached: str, first: str
) -> None:
    # Two 8-core nodes: the vLLM replica prefers the one whose cache holds the safetensors copy;
    # the GGUF copy (cached under the model's own name) is no reason to prefer a node.
    nodes = (cpu_8c_32g("a"), cpu_8c_32g("b", modelCache=[cached]))
    docs = documents(MIXED_PROFILES[1], nodes=nodes)
    [decision] = plan(docs.deployments, snapshot_from(docs), search)
    assert decision.placed[0].replica.shards[0].node == first


def test_a_profile_with_nothing_to_load_is_not_placed_and_says_why() -> None:
    docs = documents(MIXED_PROFILES[1], doc={**TINY, "alternates": []})
    snapshot = snapshot_from(Documents(nodes=docs.nodes, models=docs.models))
    [decision] = plan(docs.deployments, snapshot)
    assert not decision.placed
    [why] = [c for c in decision.conditions if c.reason == "NoLoadableWeights"]
    assert "engine vllm loads none of model tiny's formats" in why.message
    assert "add an alternate of format safetensors to model tiny" in why.message


# --- refusals at apply ---------------------------------------------------------------------------


def test_an_engine_that_loads_none_of_the_models_formats_is_refused_with_the_fix() -> None:
    docs = documents(doc={**TINY, "alternates": []})
    [problem] = check_documents(docs)
    assert (problem.location, problem.field) == ("Deployment tiny", "profiles.vllm.engine")
    assert "engine vllm loads safetensors weights, and model tiny has gguf only" in problem.message
    assert "add an alternate of format safetensors to model tiny" in problem.message
    assert check_documents(documents()) == []


def test_apply_refuses_a_deployment_and_a_model_change_that_leave_an_engine_nothing(
    sqlite_store: SqlStore,
) -> None:
    gguf_only = {**TINY, "alternates": []}
    dep = build_deployment("tiny", 2, *MIXED_PROFILES, model="tiny").model_dump(mode="json", by_alias=True)
    with pytest.raises(ConfigError) as err:
        apply_batch([gguf_only, {**dep, "kind": "Deployment"}], sqlite_store)
    assert [(p.location, p.field) for p in err.value.problems] == [
        ("Deployment tiny", "profiles.vllm.engine")
    ]
    apply_batch([TINY, {**dep, "kind": "Deployment"}], sqlite_store)
    # Dropping the alternate a stored deployment's engine serves is the Model's problem.
    with pytest.raises(ConfigError) as err:
        apply_batch([gguf_only], sqlite_store)
    [problem] = err.value.problems
    assert (problem.location, problem.field) == ("Model tiny", "alternates")
    assert "deployment tiny" in problem.message and "format safetensors" in problem.message
    assert sqlite_store.get_model("tiny") == model()


# --- the agent and Kubernetes ---------------------------------------------------------------------


def test_the_agent_fetches_and_serves_the_weights_its_engine_loads() -> None:
    replica = Replica(
        name="tiny-1", deployment="tiny", profile="vllm", shards=(Shard(node="a", cpu_cores=4),)
    )
    dep = build_deployment("tiny", 2, *MIXED_PROFILES, model="tiny")
    entry = Assignment(
        replica=replica, profile=dep.profiles[1], runtime=RuntimeVariant.CPU, driver=Driver.CPU, model=model()
    )
    chosen = served(entry).model
    assert (chosen.name, chosen.source, chosen.format) == (
        "tiny.safetensors",
        "hf://org/tiny",
        ModelFormat.SAFETENSORS,
    )
    assert served(served(entry)) == served(entry)
    # What the server sends (the weights alone) is what older agents read: no alternates field.
    wire = served(entry).model_dump(mode="json")
    assert "alternates" not in wire["model"]


KUBE = """
kind: DeviceClass
name: h100
driver: gpu.nvidia.com
memory: 80GiB
---
kind: Node
name: nv
cpu: {cores: 64, memory: 512GiB}
gpus: [{class: h100, count: 8}]
---
kind: Node
name: cpu
cpu: {cores: 64, memory: 512GiB}
---
kind: Deployment
name: tiny
model: tiny
replicas: 2
profiles:
  - {name: llama, engine: llama.cpp, cpu: {cores: 64}}
  - {name: vllm, engine: vllm, deviceClass: h100}
---
kind: Cluster
name: c
classes: [h100, cpu]
storage: {mode: replica}
"""


def test_kubernetes_pods_download_the_weights_their_engine_serves() -> None:
    docs = load_text(KUBE + "---\n" + json.dumps(TINY))
    rendered = render_cluster(docs, docs.clusters[0], [])
    pods = {
        o["metadata"]["labels"]["fleetserve.io/profile"]: o["spec"]["template"]["spec"]
        for o in rendered.applied
        if o["kind"] == "Deployment"
    }
    assert set(pods) == {"llama", "vllm"}
    llama, vllm = (pods[p]["containers"][0]["command"] for p in ("llama", "vllm"))
    assert llama[llama.index("--hf-repo") + 1 :][:3] == ["org/tiny-gguf", "--hf-file", "tiny.gguf"]
    assert vllm[vllm.index("serve") + 1] == "org/tiny" and "tiny.gguf" not in " ".join(vllm)

    def volume(profile: str) -> str:
        [models] = [v for v in pods[profile]["volumes"] if v["name"] == "models"]
        return str(models["ephemeral"]["volumeClaimTemplate"]["spec"]["resources"]["requests"]["storage"])

    # Each volume is sized by its own weights: 1 GB and 3 GB, with the headroom, in GiB.
    assert (volume("llama"), volume("vllm")) == ("2Gi", "4Gi")


def test_kubernetes_refuses_an_engine_with_nothing_to_download() -> None:
    docs = load_text(KUBE + "---\n" + json.dumps({**TINY, "alternates": []}))
    with pytest.raises(ConfigError) as err:
        render_cluster(docs, docs.clusters[0], [])
    assert any(p.field == "profiles.vllm.engine" for p in err.value.problems)


def test_the_facts_snapshot_maps_every_engine_once() -> None:
    facts = model_facts(model())
    assert set(facts.engines) == {EngineKind.VLLM}
    assert isinstance(facts.engines, MappingProxyType)
