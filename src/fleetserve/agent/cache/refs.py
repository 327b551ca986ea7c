"""The model cache's records: a ref names a model's blob (one file) or blobs (a whole repository).

``refs/<model>.json`` holds one ``Ref``: the digest (a file's sha256, or a repository's manifest
digest), size, file name or file list, format, source, the source it resolved to (a pinned
``hf://…@COMMIT``) and the last use. A ref that does not parse, or names a file outside the
allowed form, loads as None and is swept.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HEX64 = re.compile(r"[0-9a-f]{64}")
# A file name engines are given: no path separator, no leading dot.
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,199}")


@dataclass(frozen=True)
class Entry:
    """One file of a whole-repository model: its name in the directory, blob digest and size."""

    name: str
    digest: str
    size: int


@dataclass(frozen=True)
class Ref:
    """What the cache holds for one model: its blob(s), how it is named, where it came from."""

    name: str
    digest: str  # a single file: its blob; a repository: the sha256 of its manifest (names, digests)
    size: int
    file_name: str  # "" for a repository
    format: str
    source: str
    last_used: float
    files: tuple[Entry, ...] = ()  # a repository's files; empty for a single file
    resolved: str = ""

    @property
    def is_dir(self) -> bool:
        return bool(self.files)

    def blobs(self) -> dict[str, int]:
        """The blobs this model uses: digest → size."""
        if self.files:
            return {e.digest: e.size for e in self.files}
        return {self.digest: self.size}

    def dump(self) -> bytes:
        doc: dict[str, Any] = {
            "name": self.name,
            "digest": f"sha256:{self.digest}",
            "size": self.size,
            "file": self.file_name,
            "format": self.format,
            "source": self.source,
            "lastUsed": self.last_used,
        }
        if self.files:
            doc["files"] = [
                {"name": e.name, "digest": f"sha256:{e.digest}", "size": e.size} for e in self.files
            ]
        if self.resolved:
            doc["resolved"] = self.resolved
        return json.dumps(doc, sort_keys=True, indent=1).encode()

    @classmethod
    def load(cls, path: Path) -> Ref | None:
        try:
            doc: Any = json.loads(path.read_bytes())
            algorithm, _, digest = str(doc["digest"]).partition(":")
            ref = cls(
                name=str(doc["name"]),
                digest=digest,
                size=int(doc["size"]),
                file_name=str(doc["file"]),
                format=str(doc["format"]),
                source=str(doc["source"]),
                last_used=float(doc["lastUsed"]),
                files=tuple(
                    Entry(str(e["name"]), str(e["digest"]).removeprefix("sha256:"), int(e["size"]))
                    for e in doc.get("files") or ()
                ),
                resolved=str(doc.get("resolved") or ""),
            )
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None
        if algorithm != "sha256" or not HEX64.fullmatch(digest):
            return None
        if not (FILE_NAME.fullmatch(ref.file_name) or (ref.files and not ref.file_name)):
            return None
        if any(not HEX64.fullmatch(e.digest) or not FILE_NAME.fullmatch(e.name) for e in ref.files):
            return None
        return ref if path.stem == ref.name else None


def manifest_digest(entries: list[Entry]) -> str:
    """The digest naming a repository's files: sha256 over its sorted ``name digest size`` lines."""
    lines = "".join(f"{e.name} {e.digest} {e.size}\n" for e in sorted(entries, key=lambda e: e.name))
    return hashlib.sha256(lines.encode()).hexdigest()
