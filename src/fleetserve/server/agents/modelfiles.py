"""Model files the control plane holds and serves to agents (sources ``fleetserve://NAME``).

Each file is kept at ``<root>/<model>/file`` with a ``meta.json`` (sha256, size). An upload is
written to a temporary file, hashed on the way, checked against the model's sha256 when the
model names one, and only then moved into place: a failed or mismatched upload leaves nothing.

An upload is bounded: the model must declare its ``size``; the upload is refused before a byte
is written when the directory's free space is less than that, and at the first byte past it.
Directories are 0700 and files 0600 (``secretfile``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from fleetserve.errors import ConfigError, NotFound, Problem
from fleetserve.secretfile import private_dir, write_secret
from fleetserve.units import format_bytes

FreeSpace = Callable[[Path], int]


def free_space(path: Path) -> int:
    """Bytes free on the file system holding ``path``."""
    return shutil.disk_usage(path).free


def _refused(model: str, message: str) -> ConfigError:
    return ConfigError([Problem(f"Model {model}", "size", message)])


@dataclass(frozen=True)
class StoredFile:
    """A model file the server holds."""

    model: str
    path: Path
    sha256: str
    size: int


class ModelFiles:
    """The server's directory of model files."""

    def __init__(self, root: Path, free: FreeSpace = free_space) -> None:
        self.root = root
        self.free = free

    def get(self, model: str) -> StoredFile:
        """The stored file of ``model``; NotFound if none was uploaded."""
        folder = self.root / model
        try:
            meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise NotFound(
                f"no file is stored for model {model!r}; upload one with `fleetserve upload`"
            ) from None
        return StoredFile(model, folder / "file", str(meta["sha256"]), int(meta["size"]))

    async def put(
        self,
        model: str,
        chunks: AsyncIterator[bytes],
        expected_sha256: str | None,
        declared_size: int | None,
    ) -> StoredFile:
        """Store an upload of at most ``declared_size`` bytes (the model's size); refuse it,
        keeping nothing, if the model declares none, if the free space is less, if it runs past
        it, or if its sha256 is not the expected one."""
        if declared_size is None:
            raise _refused(
                model, "the model declares no size; set its size (e.g. size: 4GiB) to upload its file"
            )
        private_dir(self.root)
        folder = private_dir(self.root / model)
        free = self.free(folder)
        if free < declared_size:
            raise _refused(
                model,
                f"the model's size is {format_bytes(declared_size)} but only {format_bytes(free)} is free "
                f"in {self.root}; free space there or give the server another --models-dir",
            )
        digest = hashlib.sha256()
        size = 0
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".upload-")  # 0600
        try:
            with os.fdopen(fd, "wb") as out:
                async for chunk in chunks:
                    if size + len(chunk) > declared_size:
                        raise _refused(
                            model,
                            f"the upload runs past the model's declared size of {declared_size} bytes; "
                            "upload the model's own file, or correct its size",
                        )
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            got = digest.hexdigest()
            if expected_sha256 is not None and got != expected_sha256:
                raise ConfigError(
                    [
                        Problem(
                            f"Model {model}",
                            "sha256",
                            f"the upload's sha256 is {got}, the model says {expected_sha256}",
                        )
                    ]
                )
            os.replace(tmp, folder / "file")
            write_secret(folder / "meta.json", json.dumps({"sha256": got, "size": size}))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return StoredFile(model, folder / "file", got, size)
