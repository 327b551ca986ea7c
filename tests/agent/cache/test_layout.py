"""The model cache on disk after a crash: what the next start sweeps, and that a part is never served."""

from __future__ import annotations

from pathlib import Path

from cache_support import BODY, DIGEST, EMPTY, store_files

from fleetserve.agent.cache import ModelCache
from fleetserve.spec.resources import Model


def _local(tmp_path: Path) -> Path:
    path = tmp_path / "weights" / "tiny.gguf"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(BODY)
    return path


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
    local = _local(tmp_path)
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
