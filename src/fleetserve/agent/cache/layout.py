"""The model cache on disk: where each thing lies, how it gets there atomically, what a crash leaves.

Under the cache's root directory::

    blobs/sha256/<hex>          the weights, named by their sha256, read-only (not world-readable),
                                verified on the way in
    refs/<model>.json           model name → digest, file name(s), format, size, source, last use
    models/<model>/<file>       a relative symlink to the blob: the path engines are given, with the
                                source's file name (vLLM recognises GGUF by the ``.gguf`` suffix)
    models/<model>/             for a whole repository (``hf://ORG/REPO``): one symlink per file, and
                                the directory is what engines are given; it appears by one rename
    partial/<model>.part        a transfer in progress; ``partial/<model>.json`` makes it resumable
    partial/<model>.d/<f>.part  the same, per file of a repository

The directories are 0700: only the agent's user reads the weights or the refs. Everything lands by
rename from a temporary file in the same filesystem after an fsync, and the ref is written last: a
model is resolvable only once its verified blob is in place, and a ``.part`` is never returned.
``Layout.recover`` sweeps what a crash left half done: temporary files, refs whose blob is gone,
blobs no ref names, parts without a sidecar (copies, which cannot resume). A part with a sidecar
stays for the next download to resume.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import stat
from pathlib import Path

from fleetserve.agent.cache.refs import FILE_NAME, Entry, Ref
from fleetserve.sources import Source, source_file_name
from fleetserve.spec.resources import Model, ModelFormat

log = logging.getLogger("fleetserve.agent.cache")

# Blobs: readable by the agent's user and group, never by others; folders: the agent's user only.
BLOB_MODE = stat.S_IRUSR | stat.S_IRGRP
DIR_MODE = stat.S_IRWXU
_EXTENSIONS = {ModelFormat.GGUF: "gguf", ModelFormat.SAFETENSORS: "safetensors"}


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: a temporary file beside it, fsync, rename."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def sidecar_path(part: Path) -> Path:
    """The JSON sidecar that makes an HTTP part resumable: ``<key>.json`` beside ``<key>.part``."""
    return part.with_suffix(".json")


def discard_partial(part: Path) -> None:
    """Remove a part file and its sidecar, whichever exist."""
    for path in (part, sidecar_path(part)):
        path.unlink(missing_ok=True)


def engine_file_name(model: Model, source: Source) -> str:
    """The name engines see: the source's file name when it is a plain one, else ``<model>.<ext>``."""
    suggested = source_file_name(source)
    if suggested and FILE_NAME.fullmatch(suggested):
        return suggested
    return f"{model.name}.{_EXTENSIONS.get(model.format, 'bin')}"


class Layout:
    """The cache's directories under ``root``: paths by name and digest, and the moves between them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs = root / "blobs" / "sha256"
        self.refs = root / "refs"
        self.models = root / "models"
        self.partial = root / "partial"

    # --- paths ------------------------------------------------------------------------------------

    def part(self, name: str) -> Path:
        """Where model ``name``'s single-file transfer is written."""
        return self.partial / f"{name}.part"

    def parts_dir(self, name: str) -> Path:
        """Where model ``name``'s repository files are written, one part each (created, 0700)."""
        folder = self.partial / f"{name}.d"
        folder.mkdir(mode=DIR_MODE, exist_ok=True)
        return folder

    def link(self, ref: Ref) -> Path:
        """What engines are given: the file's symlink, or a repository's directory."""
        if ref.is_dir:
            return self.models / ref.name
        return self.models / ref.name / ref.file_name

    def intact(self, ref: Ref) -> bool:
        """Whether every file engines would read is in place at its size."""
        folder = self.models / ref.name
        wanted = ref.files or (Entry(ref.file_name, ref.digest, ref.size),)
        try:
            return all((folder / e.name).stat().st_size == e.size for e in wanted)
        except OSError:
            return False

    # --- moves ------------------------------------------------------------------------------------

    def store_blob(self, part: Path, digest: str, size: int) -> None:
        """Move a verified part into the store under its digest (dropping it when the blob is there)."""
        blob = self.blobs / digest
        if blob.is_file() and blob.stat().st_size == size:
            part.unlink()
        else:
            os.chmod(part, BLOB_MODE)
            os.replace(part, blob)
            fsync_dir(self.blobs)
        sidecar_path(part).unlink(missing_ok=True)

    def name(self, ref: Ref) -> None:
        """Link a stored model where engines look, then write its ref: the model is now resolvable."""
        self.place_link(ref)
        self.write_ref(ref)

    def write_ref(self, ref: Ref) -> None:
        """Write (or replace) model ``ref.name``'s ref."""
        atomic_write(self.refs / f"{ref.name}.json", ref.dump())

    def remove(self, ref: Ref) -> None:
        """Forget a model: its ref first (it is no longer resolvable), then its links."""
        (self.refs / f"{ref.name}.json").unlink(missing_ok=True)
        fsync_dir(self.refs)
        shutil.rmtree(self.models / ref.name, ignore_errors=True)

    def drop_blob(self, digest: str) -> None:
        """Delete a blob no ref names any longer."""
        (self.blobs / digest).unlink(missing_ok=True)

    def drop_parts_dir(self, name: str) -> None:
        """Delete what is left of model ``name``'s repository transfer."""
        shutil.rmtree(self.partial / f"{name}.d", ignore_errors=True)

    def place_link(self, ref: Ref) -> None:
        """A single file's symlink to its blob (other files in the folder go), or a repository's folder."""
        if ref.is_dir:
            self._place_dir(ref)
            return
        folder = self.models / ref.name
        folder.mkdir(parents=True, exist_ok=True)
        link = folder / ref.file_name
        tmp = folder / f".{ref.file_name}.tmp"
        tmp.unlink(missing_ok=True)
        os.symlink(Path("..", "..", "blobs", "sha256", ref.digest), tmp)
        os.replace(tmp, link)
        for other in folder.iterdir():
            if other.name != ref.file_name:
                other.unlink(missing_ok=True)
        fsync_dir(folder)

    def _place_dir(self, ref: Ref) -> None:
        """A repository's directory of symlinks, built aside and renamed into place whole."""
        tag = secrets.token_hex(4)
        tmp = self.models / f".{ref.name}.{tag}.tmp"
        tmp.mkdir(mode=DIR_MODE)
        for entry in ref.files:
            os.symlink(Path("..", "..", "blobs", "sha256", entry.digest), tmp / entry.name)
        fsync_dir(tmp)
        target = self.models / ref.name
        old = self.models / f".{ref.name}.{tag}.old"
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.exists():
            os.rename(target, old)
        os.rename(tmp, target)
        fsync_dir(self.models)
        shutil.rmtree(old, ignore_errors=True)

    # --- start ------------------------------------------------------------------------------------

    def recover(self) -> dict[str, Ref]:
        """Create the layout, sweep what a crash left half done, and return the refs that hold."""
        self.root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        folders = (self.blobs.parent, self.blobs, self.refs, self.models, self.partial)
        for folder in folders:
            folder.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        for folder in (self.root, *folders):
            os.chmod(folder, DIR_MODE)
        for folder in (self.blobs, self.refs, self.partial):
            for tmp in folder.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)
        refs: dict[str, Ref] = {}
        for path in sorted(self.refs.glob("*.json")):
            ref = Ref.load(path)
            if ref is None or not self._blobs_present(ref):
                log.warning("model cache: dropping the broken or orphaned ref %s", path)
                path.unlink(missing_ok=True)
                continue
            refs[ref.name] = ref
        named = {d for r in refs.values() for d in r.blobs()}
        for blob in self.blobs.iterdir():
            if blob.name not in named:
                blob.unlink(missing_ok=True)
        for folder in self.models.iterdir():
            if folder.name not in refs:
                if folder.is_dir() and not folder.is_symlink():
                    shutil.rmtree(folder, ignore_errors=True)
                else:
                    folder.unlink(missing_ok=True)
        for ref in refs.values():
            if not self.intact(ref):
                self.place_link(ref)
        for part in [*self.partial.glob("*.part"), *self.partial.glob("*.d/*.part")]:
            if not sidecar_path(part).is_file():
                part.unlink(missing_ok=True)  # a copy, or a download that never got its headers
        for side in [*self.partial.glob("*.json"), *self.partial.glob("*.d/*.json")]:
            if not side.with_suffix(".part").is_file():
                side.unlink(missing_ok=True)
        return refs

    def _blobs_present(self, ref: Ref) -> bool:
        for digest, size in ref.blobs().items():
            blob = self.blobs / digest
            if not blob.is_file() or blob.stat().st_size != size:
                return False
        return True
