"""The server's model files: an upload bounded by the model's declared size and the free space,
kept 0600 in 0700 directories; a refused upload keeps nothing."""

from __future__ import annotations

import asyncio
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fleetserve.errors import ConfigError
from fleetserve.server.agents.modelfiles import ModelFiles


async def pieces(*chunks: bytes) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


def put(files: ModelFiles, declared: int | None, *chunks: bytes) -> object:
    return asyncio.run(files.put("m", pieces(*chunks), None, declared))


def test_an_upload_within_the_declared_size_is_stored_0600_in_0700_directories(tmp_path: Path) -> None:
    files = ModelFiles(tmp_path / "models")
    put(files, 10, b"GGUF", b"abc")
    assert files.get("m").size == 7
    for folder in (tmp_path / "models", tmp_path / "models" / "m"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for name in ("file", "meta.json"):
        assert stat.S_IMODE((tmp_path / "models" / "m" / name).stat().st_mode) == 0o600


def test_an_upload_larger_than_the_declared_size_is_refused_and_keeps_nothing(tmp_path: Path) -> None:
    files = ModelFiles(tmp_path)
    with pytest.raises(ConfigError, match="runs past the model's declared size of 8 bytes") as caught:
        put(files, 8, b"GGUF", b"abcd", b"x" * (1 << 20))
    assert caught.value.problems[0].field == "size"
    assert list((tmp_path / "m").iterdir()) == []


def test_an_upload_larger_than_the_free_space_is_refused_before_a_byte_is_written(tmp_path: Path) -> None:
    files = ModelFiles(tmp_path, free=lambda _path: 1000)
    with pytest.raises(ConfigError, match=r"only 1000B is free .*--models-dir"):
        put(files, 4096, b"GGUF")
    assert list((tmp_path / "m").iterdir()) == []


def test_an_upload_of_a_model_without_a_declared_size_is_refused_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="declares no size; set its size"):
        put(ModelFiles(tmp_path), None, b"GGUF")
