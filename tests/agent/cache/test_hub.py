"""hf:// sources downloaded from a Hub on loopback by the real ``huggingface_hub`` client code:
a file and a whole repository, resumed, checked against the Hub's digests, pinned to a commit,
refused clearly when gated or missing. No test here reaches the internet."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_hub import FakeHub, git_blob_id, sha256

from fleetserve.agent.access import SourcePolicy
from fleetserve.agent.cache import HubAccess, ModelCache
from fleetserve.agent.runtime import check_model_path
from fleetserve.drivers import Driver, RuntimeVariant
from fleetserve.engines.launch import LaunchContext
from fleetserve.engines.registry import ENGINES
from fleetserve.engines.spec import EngineKind
from fleetserve.errors import (
    ChecksumMismatch,
    InsufficientSpace,
    SourceError,
    SourceRefused,
    TransferInterrupted,
)
from fleetserve.spec.resources import Model, ModelFormat, Profile, Replica, Shard

GGUF = os.urandom(300_000)
TOKEN = "hf_loopback_secret"


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    fake = FakeHub(token=TOKEN)
    try:
        yield fake
    finally:
        fake.close()


def cache_for(tmp_path: Path, hub: FakeHub, token: str | None = None, **kw: object) -> ModelCache:
    return ModelCache(tmp_path / "cache", hub_access=HubAccess(endpoint=hub.endpoint, token=token), **kw)  # type: ignore[arg-type]


def gguf_model(source: str, **fields: object) -> Model:
    return Model.model_validate({"name": "tiny", "source": source, "format": "gguf", **fields})


def test_a_gguf_file_is_downloaded_pinned_to_the_commit_and_checked_against_the_lfs_digest(
    tmp_path: Path, hub: FakeHub
) -> None:
    commit = hub.add("org/tiny", {"tiny.gguf": GGUF, "README.md": b"# tiny\n"})
    cache = cache_for(tmp_path, hub)

    path = cache.ensure(gguf_model("hf://org/tiny/tiny.gguf"))

    assert path.name == "tiny.gguf" and path.read_bytes() == GGUF
    (cached,) = cache.contents()
    assert cached.digest == sha256(GGUF)
    assert cached.resolved == f"hf://org/tiny/tiny.gguf@{commit}"
    # What the client asked: the metadata of main with blobs, then HEAD on the commit (not main).
    api = hub.seen("hub", "GET")
    assert api[0].path == "/api/models/org/tiny?blobs=true"
    (head,) = hub.seen("hub", "HEAD")
    assert head.path == f"/org/tiny/resolve/{commit}/tiny.gguf" and head.status == 302
    # The bytes came from the CDN the Hub redirected to, without the Hub's token.
    (get,) = hub.seen("cdn", "GET")
    assert get.status == 200 and "authorization" not in get.headers


def test_a_download_the_server_drops_mid_file_resumes_with_a_range_request(
    tmp_path: Path, hub: FakeHub
) -> None:
    hub.add("org/tiny", {"tiny.gguf": GGUF})
    hub.cut_after = [100_000]
    cache = cache_for(tmp_path, hub)

    path = cache.ensure(gguf_model("hf://org/tiny/tiny.gguf"))

    assert path.read_bytes() == GGUF
    first, second = hub.seen("cdn", "GET")
    assert "range" not in first.headers
    assert second.status == 206
    assert second.headers["range"] == "bytes=100000-"
    assert second.headers["if-range"] == f'"{sha256(GGUF)}"'


def test_a_download_cut_short_survives_an_agent_restart_and_resumes(tmp_path: Path, hub: FakeHub) -> None:
    hub.add("org/tiny", {"tiny.gguf": GGUF})
    hub.cut_after = [120_000]
    with pytest.raises(TransferInterrupted, match="gave up after 1 attempt"):
        cache_for(tmp_path, hub, attempts=1).ensure(gguf_model("hf://org/tiny/tiny.gguf"))
    # Nothing an engine could see: only the part, in partial/.
    assert not list((tmp_path / "cache" / "models").iterdir())

    path = cache_for(tmp_path, hub).ensure(gguf_model("hf://org/tiny/tiny.gguf"))

    assert path.read_bytes() == GGUF
    assert hub.seen("cdn", "GET")[-1].headers["range"] == "bytes=120000-"


def test_bytes_that_are_not_the_hubs_digest_are_refused_and_deleted(tmp_path: Path, hub: FakeHub) -> None:
    hub.add("org/tiny", {"tiny.gguf": GGUF})
    hub.corrupt = {"tiny.gguf"}
    cache = cache_for(tmp_path, hub)

    with pytest.raises(ChecksumMismatch) as caught:
        cache.ensure(gguf_model("hf://org/tiny/tiny.gguf"))

    assert caught.value.expected == sha256(GGUF)
    assert cache.contents() == []
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and "refs" not in p.parts]


def test_the_models_own_sha256_is_checked_too(tmp_path: Path, hub: FakeHub) -> None:
    hub.add("org/tiny", {"tiny.gguf": GGUF})
    with pytest.raises(ChecksumMismatch):
        cache_for(tmp_path, hub).ensure(gguf_model("hf://org/tiny/tiny.gguf", sha256="0" * 64))


def test_a_gated_repository_needs_a_token_and_the_error_says_so(tmp_path: Path, hub: FakeHub) -> None:
    hub.add("org/gated", {"tiny.gguf": GGUF}, gated=True)

    with pytest.raises(SourceError) as caught:
        cache_for(tmp_path, hub).ensure(gguf_model("hf://org/gated/tiny.gguf"))
    message = str(caught.value)
    assert "org/gated is gated" in message and "HF_TOKEN" in message and "--hf-token-file" in message
    assert hub.seen("hub")[0].status == 401

    path = cache_for(tmp_path, hub, token=TOKEN).ensure(gguf_model("hf://org/gated/tiny.gguf"))
    assert path.read_bytes() == GGUF
    assert "authorization" not in hub.seen("cdn", "GET")[0].headers  # the token stays on the Hub


@pytest.mark.parametrize(
    ("source", "fragments"),
    [
        ("hf://org/absent/tiny.gguf", ["org/absent does not exist or is private", "HF_TOKEN"]),
        ("hf://org/tiny/tiny.gguf@v9", ["org/tiny has no revision 'v9'", "after @"]),
        ("hf://org/tiny/other.gguf", ["org/tiny has no file 'other.gguf'", "tiny.gguf"]),
    ],
    ids=["a missing repository", "a missing revision", "a missing file"],
)
def test_what_the_hub_lacks_is_a_clear_error_naming_the_repository(
    tmp_path: Path, hub: FakeHub, source: str, fragments: list[str]
) -> None:
    hub.add("org/tiny", {"tiny.gguf": GGUF})
    with pytest.raises(SourceError) as caught:
        cache_for(tmp_path, hub).ensure(gguf_model(source))
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_a_revision_is_pinned_to_its_commit_and_a_new_commit_is_a_new_download(
    tmp_path: Path, hub: FakeHub
) -> None:
    first = hub.add("org/tiny", {"tiny.gguf": GGUF})
    cache = cache_for(tmp_path, hub)
    path = cache.ensure(gguf_model("hf://org/tiny/tiny.gguf"))
    newer = os.urandom(200_000)
    second = hub.add("org/tiny", {"tiny.gguf": newer})  # main moves on
    asked = len(hub.requests)

    # The cached model stays what main was when it was fetched: no request, same bytes.
    assert cache.ensure(gguf_model("hf://org/tiny/tiny.gguf")) == path
    assert path.read_bytes() == GGUF and len(hub.requests) == asked
    assert cache.contents()[0].resolved.endswith(f"@{first}")

    # Naming the new commit fetches it; the old blob goes.
    path = cache.ensure(gguf_model(f"hf://org/tiny/tiny.gguf@{second}"))
    assert path.read_bytes() == newer
    assert cache.contents()[0].resolved.endswith(f"@{second}")
    assert sorted(p.name for p in (tmp_path / "cache" / "blobs" / "sha256").iterdir()) == [sha256(newer)]


# --- whole repositories ------------------------------------------------------------------------

REPO = {
    "model-00001-of-00002.safetensors": os.urandom(150_000),
    "model-00002-of-00002.safetensors": os.urandom(90_000),
    "model.safetensors.index.json": b'{"weight_map": {}}',
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
    "generation_config.json": b'{"do_sample": false}',
    "tokenizer.json": b'{"model": {}}',
    "tokenizer_config.json": b'{"chat_template": "x"}',
    "README.md": b"# not needed\n",
    "original/consolidated.pth": b"not needed either",
    "onnx/model.safetensors": b"a subfolder: not what vLLM reads",
}
ENGINE_FILES = sorted(n for n in REPO if "/" not in n and n != "README.md")


def test_a_whole_repository_is_cached_as_one_directory_and_given_to_vllm(
    tmp_path: Path, hub: FakeHub
) -> None:
    commit = hub.add("org/llama", REPO)
    cache = cache_for(tmp_path, hub)
    model = Model.model_validate({"name": "llama", "source": "hf://org/llama", "format": "safetensors"})

    folder = cache.ensure(model)

    assert folder == tmp_path / "cache" / "models" / "llama" and folder.is_dir()
    assert sorted(p.name for p in folder.iterdir()) == ENGINE_FILES
    for name in ENGINE_FILES:
        assert (folder / name).read_bytes() == REPO[name]
    (cached,) = cache.contents()
    assert cached.files == tuple(ENGINE_FILES) and cached.resolved == f"hf://org/llama@{commit}"
    assert cached.size == sum(len(REPO[n]) for n in ENGINE_FILES)
    # Files in git were checked against their blob ids, LFS files against their sha256.
    assert git_blob_id(REPO["config.json"]) != sha256(REPO["config.json"])
    # Blobs are not world-readable; the cache's folders are the agent's user's only.
    for blob in (tmp_path / "cache" / "blobs" / "sha256").iterdir():
        assert stat.S_IMODE(blob.stat().st_mode) == 0o440
    for sub in ("", "blobs", "blobs/sha256", "refs", "models", "partial"):
        assert stat.S_IMODE((tmp_path / "cache" / sub).stat().st_mode) == 0o700

    # The vLLM adapter is given the directory.
    replica = Replica(
        name="llama-0",
        deployment="llama",
        profile="h100",
        device_class="h100",
        shards=(Shard(node="n1", devices=(0,)),),
    )
    profile = Profile(name="h100", engine=EngineKind.VLLM, device_class="h100")
    spec = ENGINES[EngineKind.VLLM].adapter.launch(
        LaunchContext(
            replica=replica,
            shard_index=0,
            profile=profile,
            variant=RuntimeVariant.CUDA,
            driver=Driver.NVIDIA,
            model_path=folder,
            binary="/opt/vllm/bin/vllm",
            host="127.0.0.1",
            port=8000,
            context=None,
        )
    )
    assert spec.argv[:3] == ("/opt/vllm/bin/vllm", "serve", str(folder))


def test_a_repository_with_one_bad_file_is_not_cached_at_all(tmp_path: Path, hub: FakeHub) -> None:
    hub.add("org/llama", REPO)
    hub.corrupt = {"model-00002-of-00002.safetensors"}
    cache = cache_for(tmp_path, hub)
    model = Model.model_validate({"name": "llama", "source": "hf://org/llama", "format": "safetensors"})

    with pytest.raises(ChecksumMismatch):
        cache.ensure(model)

    assert cache.contents() == [] and not (tmp_path / "cache" / "models" / "llama").exists()


# --- the agent's policy ------------------------------------------------------------------------


def test_a_hub_on_a_loopback_address_is_refused_unless_the_agent_allows_private_sources(
    tmp_path: Path, hub: FakeHub
) -> None:
    hub.add("org/tiny", {"tiny.gguf": GGUF})
    strict = cache_for(tmp_path, hub, policy=SourcePolicy.strict())

    with pytest.raises(SourceRefused, match=r"loopback address.*--allow-private-sources"):
        strict.ensure(gguf_model("hf://org/tiny/tiny.gguf"))
    assert hub.requests == []

    allowed = cache_for(tmp_path, hub, policy=SourcePolicy.strict(allow_private=True))
    assert allowed.ensure(gguf_model("hf://org/tiny/tiny.gguf")).read_bytes() == GGUF


def test_the_model_format_of_a_repository_is_safetensors() -> None:
    assert ModelFormat.SAFETENSORS.value == "safetensors"


def test_a_download_that_cannot_fit_is_refused_before_the_first_byte(tmp_path: Path, hub: FakeHub) -> None:
    hub.add("org/tiny", {"tiny.gguf": GGUF})
    cache = cache_for(tmp_path, hub, space_margin=2**62)

    with pytest.raises(InsufficientSpace, match="nothing was written"):
        cache.ensure(gguf_model("hf://org/tiny/tiny.gguf"))

    assert hub.seen("cdn") == []
    assert not [p for p in (tmp_path / "cache" / "partial").rglob("*") if p.is_file()]


def build_mirror(mirror: Path, repo_id: str, files: dict[str, bytes], commit: str = "ab" * 20) -> str:
    """A hub-cache layout: blobs, a snapshot of relative symlinks, refs/main naming the commit."""
    repo = mirror / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    for name, data in files.items():
        blob = repo / "blobs" / sha256(data)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs" / "main").write_text(commit)
    return commit


def test_a_whole_repository_is_read_offline_from_a_mirror(tmp_path: Path) -> None:
    commit = build_mirror(tmp_path / "mirror", "org/llama", REPO)
    cache = ModelCache(tmp_path / "cache", hf_mirror=tmp_path / "mirror")
    model = Model.model_validate({"name": "llama", "source": "hf://org/llama", "format": "safetensors"})

    folder = cache.ensure(model)

    assert sorted(p.name for p in folder.iterdir()) == ENGINE_FILES
    assert (folder / "config.json").read_bytes() == REPO["config.json"]
    assert cache.contents()[0].resolved == f"hf://org/llama@{commit}"


def test_a_whole_repository_is_refused_for_an_engine_that_loads_one_file(tmp_path: Path) -> None:
    folder = tmp_path / "models" / "llama"
    folder.mkdir(parents=True)
    with pytest.raises(SourceError, match=r"llama\.cpp loads one model file"):
        check_model_path(EngineKind.LLAMACPP, "hf://org/llama", folder)
    check_model_path(EngineKind.VLLM, "hf://org/llama", folder)
    check_model_path(EngineKind.LLAMACPP, "hf://org/tiny/tiny.gguf", tmp_path / "models" / "tiny.gguf")
