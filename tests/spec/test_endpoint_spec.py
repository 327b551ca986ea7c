"""The Endpoint kind: what apply takes, and every refusal naming the field and the fix."""

from __future__ import annotations

import pytest

from fleetserve.errors import ConfigError
from fleetserve.fleet import check_documents
from fleetserve.spec.endpoint import Endpoint, ServedModel
from fleetserve.spec.loader import load_text

BOX = "kind: Endpoint\nname: box\nurl: http://10.0.0.7:11434\n"


def refusal(text: str) -> tuple[str, str]:
    """The one problem loading ``text`` gives: (field, message)."""
    with pytest.raises(ConfigError) as caught:
        load_text(text, "e.yaml")
    (problem,) = caught.value.problems
    return problem.field, problem.message


def test_models_are_names_or_a_mapping_to_the_upstream_names() -> None:
    docs = load_text(BOX + "models: [chat, embed]\nkeyFile: box.key\nweight: 2.5\n")
    (box,) = docs.endpoints
    assert box.models == (
        ServedModel(name="chat", upstream="chat"),
        ServedModel(name="embed", upstream="embed"),
    )
    assert (box.key_file, box.weight, box.health_path, box.engine.value) == (
        "box.key",
        2.5,
        "/v1/models",
        "vllm",
    )
    mapped = load_text(BOX + "models: {chat: 'llama3.2:3b', code: qwen/qwen2.5-coder@q4}\n").endpoints[0]
    assert mapped.upstream_name("chat") == "llama3.2:3b"
    assert mapped.upstream_name("code") == "qwen/qwen2.5-coder@q4"
    assert mapped.upstream_name("other") is None
    # An https root with a base path, trailing slash dropped; the default port is the scheme's.
    hosted = Endpoint(name="h", url="https://api.example.com/openai/", models=("m",))
    assert hosted.url == "https://api.example.com/openai"


@pytest.mark.parametrize(
    ("lines", "field", "says"),
    [
        ("url: ftp://10.0.0.7\nmodels: [m]\n", "url", "http:// or https://"),
        ("url: http://10.0.0.7:8000/v1\nmodels: [m]\n", "url", "without /v1"),
        ("url: https://user:pw@api.example.com\nmodels: [m]\n", "url", "put the API key in keyFile"),
        ("url: http://10.0.0.7:8000/?x=1\nmodels: [m]\n", "url", "no query string"),
        ("url: http://10.0.0.7:99999\nmodels: [m]\n", "url", "1 to 65535"),
        ("url: http://\nmodels: [m]\n", "url", "needs a host"),
        ("url: http://10.0.0.7\nmodels: []\n", "models", "at least 1"),
        ("url: http://10.0.0.7\nmodels: [m, m]\n", "models", "repeated: ['m']"),
        ("url: http://10.0.0.7\nmodels: {m: 'has space'}\n", "models[0].upstream", "not a model name"),
        ("url: http://10.0.0.7\nmodels: [Big]\n", "models[0].name", "not a valid name"),
        ("url: http://10.0.0.7\nmodels: [m]\nkeyFile: /etc/shadow\n", "keyFile", "--endpoint-keys"),
        ("url: http://10.0.0.7\nmodels: [m]\nkeyFile: ../up.key\n", "keyFile", "no path"),
        ("url: http://10.0.0.7\nmodels: [m]\nkeyFile: .hidden\n", "keyFile", "not starting with '.'"),
        ("url: http://10.0.0.7\nmodels: [m]\nweight: 0\n", "weight", "greater than 0"),
        ("url: http://10.0.0.7\nmodels: [m]\nhealthPath: health\n", "healthPath", "starting with '/'"),
        ("url: http://10.0.0.7\nmodels: [m]\nengine: sglang\n", "engine", "valid values"),
        ("url: http://10.0.0.7\nmodels: [m]\nkey: sk-123\n", "key", "valid fields of Endpoint"),
    ],
)
def test_a_bad_endpoint_is_refused_naming_the_field_and_the_fix(lines: str, field: str, says: str) -> None:
    got_field, message = refusal("kind: Endpoint\nname: box\n" + lines)
    assert got_field == field
    assert says in message


def test_the_url_refusal_gives_the_root_to_write_instead() -> None:
    _, message = refusal(BOX.replace("11434", "11434/v1") + "models: [m]\n")
    assert message.endswith(": http://10.0.0.7:11434")


DEPLOYMENT = """
kind: Model
name: chat-gguf
source: /models/chat.gguf
size: 1GB
---
kind: Deployment
name: chat
model: chat-gguf
profiles: [{name: cpu, engine: llama.cpp, cpu: {cores: 1}}]
"""


def problems(text: str) -> list[tuple[str, str, str]]:
    return [(p.location, p.field, p.message) for p in check_documents(load_text(text))]


def test_a_deployment_lists_endpoints_that_exist_and_serve_its_name() -> None:
    listed = DEPLOYMENT + "endpoints: [box]\n---\n" + BOX + "models: {chat: 'llama3.2:3b'}\n"
    assert problems(listed) == []
    unknown = problems(DEPLOYMENT + "endpoints: [nobox]\n")
    assert unknown == [("Deployment chat", "endpoints[0]", "unknown endpoint 'nobox'; known: none defined")]
    (other,) = problems(DEPLOYMENT + "endpoints: [box]\n---\n" + BOX + "models: [embed]\n")
    assert other[:2] == ("Deployment chat", "endpoints[0]")
    assert "does not serve 'chat'" in other[2] and "add chat to its models" in other[2]


def test_an_endpoint_serving_a_deployments_name_without_being_listed_is_refused_on_both_sides() -> None:
    found = problems(DEPLOYMENT + "---\n" + BOX + "models: [chat]\n")
    assert [(loc, field) for loc, field, _ in found] == [
        ("Endpoint box", "models"),
        ("Deployment chat", "endpoints"),
    ]
    assert all("add it to the deployment's endpoints" in message for _, _, message in found)


def test_a_deployment_without_endpoints_serialises_as_before() -> None:
    (dep,) = load_text(DEPLOYMENT).deployments
    assert "endpoints" not in dep.model_dump(by_alias=True)
