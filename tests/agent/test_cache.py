"""The node agent's model cache against a real HTTP server on 127.0.0.1 and a Hugging Face mirror on disk."""

from __future__ import annotations

import io
import shutil
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cache_support import FileServer, build_hf_mirror, payload, sha256
from rich.console import Console

from fleetserve.agent.cache import CacheState, ModelCache
from fleetserve.agent.hub import HubAccess
from fleetserve.agent.progress import rich_progress
from fleetserve.errors import (
    CacheError,
    ChecksumMismatch,
    InsufficientSpace,
    ModelPinned,
    SourceError,
    TransferInterrupted,
)
from fleetserve.sources import parse_source
from fleetserve.spec.resources import Model
from fleetserve.tls import ServerTrust, client_verify, ensure_generated

BODY = payload(300_000)
DIGEST = sha256(BODY)
TOKEN = "fs_node_credential-123"
CONTROL_PATH = "/api/v1/agent/models/tiny/file"


@pytest.fixture
def server() -> Iterator[FileServer]:
    fs = FileServer()
    fs.files["/models/tiny.gguf"] = BODY
    fs.files[CONTROL_PATH] = BODY
    try:
        yield fs
    finally:
        fs.close()


def store_files(root: Path) -> dict[str, list[str]]:
    """What the cache holds on disk, per area (temporary and hidden files included)."""
    return {
        area: sorted(str(p.relative_to(root / area)) for p in (root / area).rglob("*") if not p.is_dir())
        for area in ("blobs", "refs", "models", "partial")
    }


EMPTY: dict[str, list[str]] = {"blobs": [], "refs": [], "models": [], "partial": []}


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


def test_a_part_file_is_never_returned_and_one_without_sidecar_is_discarded_at_start(tmp_path: Path) -> None:
    partial = tmp_path / "cache" / "partial"
    partial.mkdir(parents=True)
    (partial / "tiny.part").write_bytes(BODY)  # complete bytes, but never committed
    (partial / "other.json").write_text('{"url": "http://127.0.0.1:9/x", "etag": "\\"1\\"", "size": 3}')

    cache = ModelCache(tmp_path / "cache")

    assert cache.get("tiny") is None
    assert cache.contents() == []
    assert cache.status() == []
    assert store_files(tmp_path / "cache") == EMPTY


def test_a_crash_between_blob_and_ref_is_swept_at_start(tmp_path: Path) -> None:
    local = _local(World(tmp_path, None, tmp_path))  # type: ignore[arg-type]
    cache = ModelCache(tmp_path / "cache")
    cache.ensure(Model(name="tiny", source=str(local)))
    root = tmp_path / "cache"
    (root / "blobs" / "sha256" / ("f" * 64)).write_bytes(b"orphan")
    (root / "refs" / "broken.json").write_text("{not json")
    (root / "refs" / ".tiny.json.1234.tmp").write_text("{}")
    (root / "models" / "tiny" / "tiny.gguf").unlink()

    again = ModelCache(root)

    assert store_files(root) == {
        "blobs": [f"sha256/{DIGEST}"],
        "refs": ["tiny.json"],
        "models": ["tiny/tiny.gguf"],
        "partial": [],
    }
    assert again.get("tiny") is not None


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


# --- eviction -------------------------------------------------------------------------------


def _models(tmp_path: Path, *names: str, size: int = 50_000) -> dict[str, Model]:
    out = {}
    for i, name in enumerate(names):
        path = tmp_path / "src" / f"{name}.gguf"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(payload(size, seed=i + 1))
        out[name] = Model(name=name, source=str(path))
    return out


@dataclass(frozen=True)
class EvictionCase:
    name: str
    steps: list[str]  # "ensure X", "get X", "pin X", "unpin X"
    held: list[str]
    over_cap: bool = False


EVICTIONS = [
    EvictionCase(
        "the least recently used model goes first", ["ensure a", "ensure b", "ensure c"], ["b", "c"]
    ),
    EvictionCase("a get() counts as a use", ["ensure a", "ensure b", "get a", "ensure c"], ["a", "c"]),
    EvictionCase(
        "a pinned model survives though least recently used",
        ["ensure a", "ensure b", "pin a", "ensure c"],
        ["a", "c"],
    ),
    EvictionCase(
        "pins counted per replica: one unpin of two keeps it",
        ["ensure a", "pin a", "pin a", "unpin a", "ensure b", "ensure c"],
        ["a", "c"],
    ),
    EvictionCase(
        "an unpinned model is evictable again",
        ["ensure a", "pin a", "ensure b", "unpin a", "ensure c"],
        ["b", "c"],
    ),
    EvictionCase(
        "when pins keep the cache over its cap it stays over and says so, and the download succeeds",
        ["ensure a", "ensure b", "pin a", "pin b", "ensure c"],
        ["a", "b", "c"],
        over_cap=True,
    ),
]


@pytest.mark.parametrize("case", EVICTIONS, ids=lambda c: c.name)
def test_eviction_keeps_the_cache_under_its_cap_by_lru_never_a_pinned_model(
    case: EvictionCase, tmp_path: Path
) -> None:
    models = _models(tmp_path, "a", "b", "c")
    cache = ModelCache(tmp_path / "cache", max_bytes=120_000)  # two models of 50 kB fit, three do not

    for step in case.steps:
        verb, name = step.split()
        if verb == "ensure":
            cache.ensure(models[name])
        else:
            getattr(cache, verb)(name)

    assert [m.name for m in cache.contents()] == case.held
    assert sorted(store_files(tmp_path / "cache")["blobs"]) == sorted(
        f"sha256/{m.digest}" for m in cache.contents()
    )
    assert (cache.total_bytes() > 120_000) == case.over_cap
    if case.over_cap:
        assert cache.over_cap is not None
        assert "over its cap of" in cache.over_cap
        assert "pinned by running replicas: a, b" in cache.over_cap
    else:
        assert cache.over_cap is None


def test_a_blob_shared_by_two_models_counts_once_and_outlives_either(tmp_path: Path) -> None:
    (model,) = _models(tmp_path, "a").values()
    twin = Model(name="twin", source=model.source)
    cache = ModelCache(tmp_path / "cache", max_bytes=60_000)

    cache.ensure(model)
    cache.ensure(twin)

    assert [m.name for m in cache.contents()] == ["a", "twin"]
    assert cache.total_bytes() == 50_000
    assert cache.evict("a") is True
    twin_path = cache.get("twin")
    assert twin_path is not None and twin_path.read_bytes() == Path(model.source).read_bytes()
    assert len(store_files(tmp_path / "cache")["blobs"]) == 1
    assert cache.evict("twin") is True
    assert cache.evict("twin") is False
    assert store_files(tmp_path / "cache") == EMPTY


def test_an_explicit_eviction_of_a_pinned_model_needs_force(tmp_path: Path) -> None:
    (model,) = _models(tmp_path, "a").values()
    cache = ModelCache(tmp_path / "cache")
    cache.ensure(model)
    cache.pin("a")

    with pytest.raises(ModelPinned, match="model 'a' is pinned by 1 running replica"):
        cache.evict("a")
    assert cache.contents()[0].pinned is True

    assert cache.evict("a", force=True) is True
    assert cache.get("a") is None


def test_a_redefined_model_is_fetched_again_and_its_old_blob_dropped(tmp_path: Path) -> None:
    old, new = _models(tmp_path, "old", "new").values()
    cache = ModelCache(tmp_path / "cache")
    cache.ensure(Model(name="m", source=old.source))

    cache.ensure(Model(name="m", source=new.source))

    (held,) = cache.contents()
    assert held.digest == sha256(Path(new.source).read_bytes())
    assert store_files(tmp_path / "cache")["blobs"] == [f"sha256/{held.digest}"]
    assert store_files(tmp_path / "cache")["models"] == ["m/new.gguf"]


# --- progress and concurrency ---------------------------------------------------------------


@dataclass
class Recorder:
    calls: list[tuple[str, int, int | None, float, float]] = field(default_factory=list)
    statuses: list[list[tuple[str, CacheState]]] = field(default_factory=list)
    cache: ModelCache | None = None

    def __call__(self, model: Model, done: int, total: int | None, rate: float) -> None:
        self.calls.append((model.name, done, total, rate, time.monotonic()))
        if self.cache is not None:
            self.statuses.append([(s.model, s.state) for s in self.cache.status()])


def test_progress_is_reported_with_increasing_bytes_at_most_ten_times_a_second(
    tmp_path: Path, server: FileServer
) -> None:
    big = payload(1_000_000, seed=7)
    server.files["/models/big.gguf"] = big
    server.delay = 0.008  # 16 KiB every 8 ms: about half a second
    cache = ModelCache(tmp_path / "cache")
    record = Recorder(cache=cache)

    started = time.monotonic()
    cache.ensure(Model(name="big", source=server.url("/models/big.gguf")), on_progress=record)
    elapsed = time.monotonic() - started

    done = [c[1] for c in record.calls]
    assert done == sorted(set(done)), "bytes strictly increase"
    assert done[-1] == len(big)
    assert {c[2] for c in record.calls} == {len(big)}
    assert 3 <= len(record.calls) <= elapsed * 10 + 2
    gaps = [b[4] - a[4] for a, b in zip(record.calls, record.calls[1:-1], strict=False)]
    assert all(gap >= 0.09 for gap in gaps)
    assert all(c[3] > 0 for c in record.calls[1:])
    assert ("big", CacheState.DOWNLOADING) in record.statuses[1]
    assert [(s.model, s.state) for s in cache.status()] == [("big", CacheState.READY)]


def test_two_ensures_of_one_model_share_one_download(tmp_path: Path, server: FileServer) -> None:
    server.delay = 0.02  # about 0.4 s for the whole body
    cache = ModelCache(tmp_path / "cache")
    model = Model(name="tiny", source=server.url("/models/tiny.gguf"), sha256=DIGEST)
    results: list[Path] = []
    joiner = Recorder()

    def second_ensure() -> None:
        results.append(cache.ensure(model, on_progress=joiner))

    second = threading.Thread(target=second_ensure)

    def owner(model: Model, done: int, total: int | None, rate: float) -> None:
        if not second.is_alive() and not second.ident:
            second.start()  # while the first download is in flight

    results.append(cache.ensure(model, on_progress=owner))
    second.join(timeout=20)

    assert len(results) == 2 and results[0] == results[1]
    assert len(server.gets()) == 1
    assert joiner.calls[0][1] < len(BODY), (
        "the second call saw the shared download's progress, not a cache hit"
    )
    assert joiner.calls[-1][1] == len(BODY)


def test_the_rich_progress_helper_draws_a_bar_per_model(tmp_path: Path, server: FileServer) -> None:
    out = io.StringIO()
    cache = ModelCache(tmp_path / "cache")

    with rich_progress(Console(file=out, force_terminal=True, width=120)) as on_progress:
        cache.ensure(Model(name="tiny", source=server.url("/models/tiny.gguf")), on_progress)

    text = out.getvalue()
    assert "tiny" in text
    assert "300.0/300.0 kB" in text


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
