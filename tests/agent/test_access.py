"""The sources an agent may read: local files only under its model directories (no symlink out),
no loopback, link-local or metadata addresses unless allowed (redirects included), and the
control plane's files checked against the digest it announces. Each test plays the attacker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.cache.cache_support import FileServer, payload, sha256
from fleetserve.agent.access import SourcePolicy, forbidden_reason
from fleetserve.agent.cache import ModelCache
from fleetserve.agent.cache.transfer import fetch
from fleetserve.errors import ChecksumMismatch, SourceRefused
from fleetserve.spec.resources import Model

BODY = payload(50_000)


@pytest.fixture
def server() -> Iterator[FileServer]:
    fs = FileServer()
    try:
        yield fs
    finally:
        fs.close()


def model(source: str) -> Model:
    return Model(name="m", source=source)


def test_a_local_file_under_a_model_directory_is_read(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.gguf").write_bytes(BODY)
    cache = ModelCache(tmp_path / "cache", policy=SourcePolicy.strict([tmp_path / "models"]))
    assert cache.ensure(model(str(tmp_path / "models" / "m.gguf"))).read_bytes() == BODY


@pytest.mark.parametrize(
    ("where", "fragment"),
    [
        ("outside", "outside the agent's model directories"),
        ("symlink", "resolves to"),
        ("dotdot", "outside the agent's model directories"),
    ],
    ids=[
        "a file outside every model directory",
        "a symlink out of a model directory",
        "a ../ path out of one",
    ],
)
def test_a_local_source_outside_the_model_directories_is_refused(
    tmp_path: Path, where: str, fragment: str
) -> None:
    (tmp_path / "models").mkdir()
    secret = tmp_path / "secret.key"
    secret.write_bytes(b"private key material")
    (tmp_path / "models" / "link.gguf").symlink_to(secret)
    source = {
        "outside": str(secret),
        "symlink": str(tmp_path / "models" / "link.gguf"),
        "dotdot": str(tmp_path / "models" / ".." / "secret.key"),
    }[where]
    cache = ModelCache(tmp_path / "cache", policy=SourcePolicy.strict([tmp_path / "models"]))

    with pytest.raises(SourceRefused, match=fragment):
        cache.ensure(model(source))
    assert cache.contents() == []
    assert not list((tmp_path / "cache" / "blobs" / "sha256").iterdir())


def test_an_agent_without_a_model_directory_reads_no_local_file(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(BODY)
    cache = ModelCache(tmp_path / "cache", policy=SourcePolicy.strict())
    with pytest.raises(SourceRefused, match="--model-dir"):
        cache.ensure(model(str(tmp_path / "m.gguf")))


def test_an_http_source_on_loopback_is_refused_without_the_allow_flag(
    tmp_path: Path, server: FileServer
) -> None:
    server.files["/m.gguf"] = BODY
    strict = ModelCache(tmp_path / "cache", policy=SourcePolicy.strict())
    with pytest.raises(SourceRefused, match=r"127\.0\.0\.1 is a loopback address"):
        strict.ensure(model(server.url("/m.gguf")))
    assert server.requests == []

    allowed = ModelCache(tmp_path / "cache", policy=SourcePolicy.strict(allow_private=True))
    assert allowed.ensure(model(server.url("/m.gguf"))).read_bytes() == BODY


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("169.254.169.254", "a cloud metadata address"),
        ("fd00:ec2::254", "a cloud metadata address"),
        ("169.254.10.1", "a link-local address"),
        ("fe80::1", "a link-local address"),
        ("127.0.0.53", "a loopback address"),
        ("::1", "a loopback address"),
        ("::ffff:127.0.0.1", "a loopback address"),
        ("0.0.0.0", "the unspecified address"),
        ("10.0.0.7", None),
        ("203.0.113.9", None),
    ],
)
def test_which_addresses_are_private(address: str, reason: str | None) -> None:
    assert forbidden_reason(address) == reason


def test_a_host_name_is_checked_by_what_it_resolves_to() -> None:
    table = {"models.internal": ["192.0.2.8"], "sneaky.example": ["169.254.169.254"]}
    policy = SourcePolicy(allow_private=False, resolver=lambda host, port: table.get(host, []))
    policy.check_url("https://models.internal/m.gguf")
    with pytest.raises(SourceRefused, match=r"169\.254\.169\.254 is a cloud metadata address"):
        policy.check_url("https://sneaky.example/m.gguf")
    with pytest.raises(SourceRefused, match="metadata host"):
        policy.check_url("http://metadata.google.internal/computeMetadata/v1/")


def test_a_redirect_to_a_metadata_address_is_refused_before_it_is_followed(
    tmp_path: Path, server: FileServer
) -> None:
    server.redirects["/m.gguf"] = "http://169.254.169.254/latest/meta-data/iam/security-credentials/"
    policy = SourcePolicy.strict()
    seen: list[str] = []

    def guard(url: str) -> None:
        seen.append(url)
        if not url.startswith(server.base_url):  # the first hop stands in for a public server
            policy.check_url(url)

    with pytest.raises(SourceRefused, match=r"169\.254\.169\.254 is a cloud metadata address"):
        fetch(server.url("/m.gguf"), tmp_path / "m.part", guard=guard, timeout=5)
    assert seen == [
        server.url("/m.gguf"),
        "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
    ]


def test_a_control_plane_file_that_is_not_the_announced_digest_is_refused(
    tmp_path: Path, server: FileServer
) -> None:
    server.files["/api/v1/agent/models/m/file"] = BODY
    server.announce["/api/v1/agent/models/m/file"] = sha256(b"what the server stored")
    cache = ModelCache(tmp_path / "cache", control_plane=(server.base_url, "join-token"))

    with pytest.raises(ChecksumMismatch) as caught:
        cache.ensure(model("fleetserve://m"))

    assert caught.value.expected == sha256(b"what the server stored")
    assert cache.contents() == []
