"""Model files the control plane holds and serves to agents (sources ``fleetserve://NAME``).

Each file is kept at ``<root>/<model>/file`` with a ``meta.json`` (sha256, size). An upload is
written to a temporary file, hashed on the way, checked against the model's sha256 when the
model names one, and only then moved into place: a failed or mismatched upload leaves nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from fleetserve.errors import ConfigError, NotFound, Problem


@dataclass(frozen=True)
class StoredFile:
    """A model file the server holds."""

    model: str
    path: Path
    sha256: str
    size: int


class ModelFiles:
    """The server's directory of model files."""

    def __init__(self, root: Path) -> None:
        self.root = root

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

    async def put(self, model: str, chunks: AsyncIterator[bytes], expected_sha256: str | None) -> StoredFile:
        """Store an upload; refuse it (keeping nothing) if its sha256 is not the expected one."""
        folder = self.root / model
        folder.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        size = 0
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".upload-")
        try:
            with os.fdopen(fd, "wb") as out:
                async for chunk in chunks:
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
            (folder / "meta.json").write_text(json.dumps({"sha256": got, "size": size}), encoding="utf-8")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return StoredFile(model, folder / "file", got, size)
