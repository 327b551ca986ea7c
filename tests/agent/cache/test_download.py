"""The model cache's downloads against a real HTTP server on 127.0.0.1 and a Hugging Face mirror on
disk: each source, each failure, resuming, free disk, a control plane behind TLS."""

from __future__ import annotations

import shutil
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cache_support import BODY, CONTROL_PATH, DIGEST, EMPTY, FileServer, build_hf_mirror, store_files

from fleetserve.agent.cache import CacheState, HubAccess, ModelCache
from fleetserve.errors import (
    CacheError,
    ChecksumMismatch,
    InsufficientSpace,
    SourceError,
    TransferInterrupted,
)
from fleetserve.sources import parse_source
from fleetserve.spec.resources import Model
from fleetserve.tls import ServerTrust, client_verify, ensure_generated

TOKEN = "fs_node_credential-123"


# --- sources --------------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    tmp: Path
    server: FileServer
    mirror: Path


@dataclass(frozen=True)
class SourceCase:
    name: str
    source: Callable[[World], str]
    file_name: str = "tiny.gguf"
    cache_args: Callable[[World], dict[str, Any]] = lambda w: {}
    check: Callable[[World], None] = lambda w: None
    token_required: bool = False


def _local(world: World) -> Path:
    path = world.tmp / "weights" / "tiny.gguf"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(BODY)
    return path


def _control_plane_saw_the_token(world: World) -> None:
    (get,) = world.server.gets()
    assert get.path == CONTROL_PATH
    assert get.headers["authorization"] == f"Bearer {TOKEN}"


def _plain_http_got_no_token(world: World) -> None:
    (get,) = world.server.gets()
    assert "authorization" not in get.headers


MIRROR_COMMIT = "ab" * 20


def _hf(world: World) -> dict[str, Any]:
    build_hf_mirror(world.mirror, "org/repo", {"gguf/q4/tiny-q4.gguf": BODY}, commit=MIRROR_COMMIT)
    return {"hf_mirror": world.mirror}


SOURCES = [
    SourceCase("a local absolute path is copied in", lambda w: str(_local(w))),
    SourceCase("a relative ./path is copied in", lambda w: "./" + str(_local(w).relative_to(w.tmp))),
    SourceCase("a file:// URL is copied in", lambda w: _local(w).as_uri()),
    SourceCase(
        "an http URL is streamed without the node credential, even with a control plane set",
        lambda w: w.server.url("/models/tiny.gguf"),
        cache_args=lambda w: {"control_plane": ("http://127.0.0.1:9", TOKEN)},
        check=_plain_http_got_no_token,
    ),
    SourceCase(
        "a fleetserve:// source is fetched from the control plane with the node credential",
        lambda w: "fleetserve://tiny",
        file_name="tiny.gguf",
        cache_args=lambda w: {"control_plane": (w.server.base_url, TOKEN)},
        check=_control_plane_saw_the_token,
        token_required=True,
    ),
    SourceCase(
        "an http URL on the control plane carries the node credential",
        lambda w: w.server.url(CONTROL_PATH),
        file_name="file",
        cache_args=lambda w: {"control_plane": (w.server.base_url + "/", TOKEN)},
        check=_control_plane_saw_the_token,
        token_required=True,
    ),
    SourceCase(
        "an hf:// source is read offline from the mirror's main branch",
        lambda w: "hf://org/repo/gguf/q4/tiny-q4.gguf",
        file_name="tiny-q4.gguf",
        cache_args=_hf,
    ),
    SourceCase(
        "an hf:// source at a commit is read offline from the mirror",
        lambda w: f"hf://org/repo/gguf/q4/tiny-q4.gguf@{MIRROR_COMMIT}",
        file_name="tiny-q4.gguf",
        cache_args=_hf,
    ),
]


@pytest.mark.parametrize("case", SOURCES, ids=lambda c: c.name)
@pytest.mark.parametrize("checksum", [True, False], ids=["with its sha256", "recording the sha256"])
def test_each_source_lands_verified_in_the_content_addressed_store(
    case: SourceCase,
    checksum: bool,
    tmp_path: Path,
    server: FileServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    server.token = TOKEN if case.token_required else None
    world = World(tmp_path, server, tmp_path / "mirror")
    source = case.source(world)
    cache = ModelCache(tmp_path / "cache", **case.cache_args(world))
    model = Model(name="tiny", source=source, sha256=DIGEST if checksum else None)

    path = cache.ensure(model)

    assert path == tmp_path / "cache" / "models" / "tiny" / case.file_name
    assert path.read_bytes() == BODY
    assert path.resolve() == tmp_path / "cache" / "blobs" / "sha256" / DIGEST
    assert cache.get("tiny") == path
    (held,) = cache.contents()
    assert (held.name, held.digest, held.size, held.source) == ("tiny", DIGEST, len(BODY), source)
    assert [(s.model, s.state, s.done, s.total) for s in cache.status()] == [
        ("tiny", CacheState.READY, len(BODY), len(BODY))
    ]
    assert store_files(tmp_path / "cache")["partial"] == []
    case.check(world)
    # A second ensure is a cache hit: no transfer.
    requests = len(server.requests)
    assert cache.ensure(model) == path
    assert len(server.requests) == requests


# --- failures -------------------------------------------------------------------------------


@dataclass(frozen=True)
class FailureCase:
    name: str
    source: Callable[[World], str]
    error: type[CacheError]
    message: list[str]
    sha: str | None = None
    cache_args: Callable[[World], dict[str, Any]] = lambda w: {}
    token: str | None = None


WRONG = "0" * 64

FAILURES = [
    FailureCase(
        "an http download whose sha256 differs is rejected and deleted",
        lambda w: w.server.url("/models/tiny.gguf"),
        ChecksumMismatch,
        ["checksum mismatch", f"expected sha256 {WRONG}", f"got {DIGEST}", "/models/tiny.gguf", "deleted"],
        sha=WRONG,
    ),
    FailureCase(
        "a local file whose sha256 differs is rejected",
        lambda w: str(_local(w)),
        ChecksumMismatch,
        [f"expected sha256 {WRONG}", f"got {DIGEST}", "weights/tiny.gguf"],
        sha=WRONG,
    ),
    FailureCase(
        "a wrong node credential is refused by the control plane",
        lambda w: "fleetserve://tiny",
        SourceError,
        ["model 'tiny'", "HTTP 401", "refused the node's credential", CONTROL_PATH],
        cache_args=lambda w: {"control_plane": (w.server.base_url, "wrong-token")},
        token=TOKEN,
    ),
    FailureCase(
        "a fleetserve:// source without a control plane configured",
        lambda w: "fleetserve://tiny",
        SourceError,
        ["fleetserve:// sources need the control plane's URL and a credential"],
    ),
    FailureCase(
        "a file the hf mirror lacks is a clear error, offline",
        lambda w: "hf://org/repo/gguf/missing.gguf",
        SourceError,
        [
            "not found in the Hugging Face mirror",
            "offline",
            "models--org--repo/snapshots/<commit>/gguf/missing.gguf",
        ],
        cache_args=_hf,
    ),
    FailureCase(
        "a revision the hf mirror lacks is a clear error",
        lambda w: "hf://org/repo/gguf/q4/tiny-q4.gguf@v2",
        SourceError,
        ["not found in the Hugging Face mirror", "refs/v2"],
        cache_args=_hf,
    ),
    FailureCase(
        "an hf:// source without a mirror asks the Hub, and a Hub that does not answer is a clear error",
        lambda w: "hf://org/repo/tiny.gguf",
        SourceError,
        ["hf://org/repo/tiny.gguf", "cannot reach the Hub"],
        cache_args=lambda w: {"hub_access": HubAccess(endpoint="http://127.0.0.1:9")},
    ),
    FailureCase(
        "a missing local file",
        lambda w: str(w.tmp / "nowhere.gguf"),
        SourceError,
        ["nowhere.gguf: no such file"],
    ),
    FailureCase(
        "an http 404",
        lambda w: w.server.url("/models/absent.gguf"),
        SourceError,
        ["HTTP 404", "/models/absent.gguf", "no such file on the server"],
    ),
    FailureCase(
        "an unsupported scheme",
        lambda w: "s3://bucket/tiny.gguf",
        SourceError,
        ["unsupported source scheme 's3'"],
    ),
    FailureCase("a model without a source", lambda w: "", SourceError, ["has no source"]),
]


@pytest.mark.parametrize("case", FAILURES, ids=lambda c: c.name)
def test_a_failed_fetch_says_why_and_leaves_nothing_behind(
    case: FailureCase, tmp_path: Path, server: FileServer
) -> None:
    server.token = case.token
    world = World(tmp_path, server, tmp_path / "mirror")
    source = case.source(world)
    cache = ModelCache(tmp_path / "cache", **case.cache_args(world))

    with pytest.raises(case.error) as caught:
        cache.ensure(Model(name="tiny", source=source, sha256=case.sha))

    for fragment in case.message:
        assert fragment in str(caught.value)
    assert store_files(tmp_path / "cache") == EMPTY
    assert cache.get("tiny") is None
    assert cache.contents() == []
    (status,) = cache.status()
    assert (status.model, status.state, status.error) == ("tiny", CacheState.FAILED, str(caught.value))


# --- resuming -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResumeCase:
    name: str
    server: dict[str, bool]
    if_range: str | None  # "etag", "last-modified" or None: no Range asked
    second_status: int


RESUMES = [
    ResumeCase(
        "an interrupted download resumes with Range and If-Range: ETag, and gets 206", {}, "etag", 206
    ),
    ResumeCase(
        "without an ETag the resume validates with Last-Modified",
        {"etag": False},
        "last-modified",
        206,
    ),
    ResumeCase(
        "a server without Range support answers 200 and the download restarts from zero",
        {"ranges": False},
        "etag",
        200,
    ),
    ResumeCase(
        "without any validator nothing is resumed: the second request starts from zero",
        {"etag": False, "last_modified": False},
        None,
        200,
    ),
]


@pytest.mark.parametrize("case", RESUMES, ids=lambda c: c.name)
def test_an_interrupted_download_is_resumed_or_restarted(
    case: ResumeCase, tmp_path: Path, server: FileServer
) -> None:
    for key, value in case.server.items():
        setattr(server, key, value)
    server.cut_after = [100_000]
    cache = ModelCache(tmp_path / "cache")
    seen: list[int] = []

    path = cache.ensure(
        Model(name="tiny", source=server.url("/models/tiny.gguf"), sha256=DIGEST),
        on_progress=lambda m, done, total, rate: seen.append(done),
    )

    assert path.read_bytes() == BODY
    first, second = server.gets()
    assert (first.status, "range" in first.headers) == (200, False)
    assert second.status == case.second_status
    if case.if_range is None:
        assert "range" not in second.headers
    else:
        assert second.headers["range"] == "bytes=100000-"
        expected = server.etag_of(BODY) if case.if_range == "etag" else first_header(server, "last-modified")
        assert second.headers["if-range"] == expected
    assert seen[-1] == len(BODY)
    assert store_files(tmp_path / "cache")["partial"] == []


def first_header(server: FileServer, name: str) -> str:
    import httpx

    return httpx.head(server.url("/models/tiny.gguf")).headers[name]


def test_a_crash_mid_download_leaves_only_a_part_that_the_next_start_resumes(
    tmp_path: Path, server: FileServer
) -> None:
    server.cut_after = [120_000]
    model = Model(name="tiny-3.1", source=server.url("/models/tiny.gguf"), sha256=DIGEST)
    first = ModelCache(tmp_path / "cache", attempts=1)

    with pytest.raises(
        TransferInterrupted, match=r"broke off after 120000 of 300000 bytes.*next attempt resumes"
    ):
        first.ensure(model)

    assert store_files(tmp_path / "cache") == {**EMPTY, "partial": ["tiny-3.1.json", "tiny-3.1.part"]}
    assert (tmp_path / "cache" / "partial" / "tiny-3.1.part").stat().st_size == 120_000
    assert first.get("tiny-3.1") is None
    assert first.contents() == []
    assert [(s.state, s.done, s.total) for s in first.status()] == [(CacheState.FAILED, 120_000, 300_000)]

    restarted = ModelCache(tmp_path / "cache")
    assert restarted.ensure(model).read_bytes() == BODY
    assert [(g.status, g.headers.get("range")) for g in server.gets()] == [
        (200, None),
        (206, "bytes=120000-"),
    ]
    assert store_files(tmp_path / "cache")["partial"] == []


# --- disk space -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SpaceCase:
    name: str
    advertise: bool
    model_size: bool
    requests: int


SPACE = [
    SpaceCase("a Content-Length beyond the free disk is refused before a byte is written", True, False, 1),
    SpaceCase("a model size beyond the free disk is refused before any request", False, True, 0),
]


@pytest.mark.parametrize("case", SPACE, ids=lambda c: c.name)
def test_a_download_that_cannot_fit_is_refused_up_front(
    case: SpaceCase, tmp_path: Path, server: FileServer
) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    huge = shutil.disk_usage(root).free + 2**40
    if case.advertise:
        server.advertise["/models/tiny.gguf"] = huge
    cache = ModelCache(root)
    model = Model(name="tiny", source=server.url("/models/tiny.gguf"), size=huge if case.model_size else None)

    with pytest.raises(InsufficientSpace) as caught:
        cache.ensure(model)

    message = str(caught.value)
    assert f"cache directory {root}" in message
    assert f"({huge} bytes)" in message
    assert "is free; nothing was written" in message
    assert caught.value.needed == huge
    assert caught.value.free < huge
    assert store_files(root) == EMPTY
    assert len(server.gets()) == case.requests


# --- malformed sources and TLS ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("hf://org", "or hf://ORG/REPO[@REVISION]"),
        ("hf://org/../x.gguf", "expected hf://ORG/REPO/PATH/IN/REPO[@REVISION]"),
        ("hf://org/repo/file.gguf@", "expected hf://ORG/REPO/PATH/IN/REPO[@REVISION]"),
        ("fleetserve://a/b", "expected fleetserve://MODEL-NAME"),
        ("file://host/x.gguf", "file:// URLs must name a local file"),
        ("https:///x.gguf", "the URL has no host"),
    ],
    ids=[
        "an hf source without a repository",
        "an hf source with a dot-dot segment",
        "an hf source with an empty revision",
        "a fleetserve source with a path",
        "a remote file URL",
        "an http URL without a host",
    ],
)
def test_a_malformed_source_is_refused_with_the_expected_form(source: str, message: str) -> None:
    with pytest.raises(SourceError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_source(source)


def test_a_control_plane_behind_tls_is_fetched_from_only_when_verified_by_its_ca(
    tmp_path: Path, server: FileServer
) -> None:
    """The agent's verification of the control plane (its pinned CA) covers model files too; a
    cache that trusts only the system's CAs refuses the generated certificate."""
    served = ensure_generated(tmp_path / "tls", "server", ["127.0.0.1"])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(served.cert_file, served.key_file)
    server._httpd.socket = context.wrap_socket(server._httpd.socket, server_side=True)
    server.token = TOKEN
    base = server.base_url.replace("http://", "https://")
    assert served.ca_file is not None
    verify = client_verify(base, ServerTrust(ca_file=served.ca_file, ca_hash=served.pin))
    model = Model(name="tiny", source="fleetserve://tiny", sha256=DIGEST)

    unverified = ModelCache(tmp_path / "system", control_plane=(base, TOKEN), attempts=1)
    with pytest.raises(SourceError, match="CERTIFICATE_VERIFY_FAILED"):
        unverified.ensure(model)
    assert server.gets() == []

    cache = ModelCache(tmp_path / "cache", control_plane=(base, TOKEN), control_plane_verify=verify)
    assert cache.ensure(model).read_bytes() == BODY
    (get,) = server.gets()
    assert get.path == CONTROL_PATH and get.headers["authorization"] == f"Bearer {TOKEN}"
