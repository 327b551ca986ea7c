"""The model cache as the agent uses it: eviction under a cap by LRU with pins, shared blobs,
explicit eviction, a redefined model, and one download shared by concurrent callers."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from cache_support import BODY, DIGEST, EMPTY, FileServer, Recorder, payload, sha256, store_files

from fleetserve.agent.cache import ModelCache
from fleetserve.errors import ModelPinned
from fleetserve.spec.resources import Model

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


# --- concurrency ---------------------------------------------------------------------------


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
