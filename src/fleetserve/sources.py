"""Model sources as values: what a model's ``source`` string names, parsed without any I/O.

- a local path (``/abs/model.gguf``, ``./rel/model.gguf``, ``file:///abs/model.gguf``);
- an ``http(s)://`` URL;
- ``fleetserve://NAME``: the control plane's copy of a model;
- ``hf://ORG/REPO/PATH/IN/REPO[@REVISION]``: a file of a Hugging Face repository;
- ``hf://ORG/REPO[@REVISION]``: a whole Hugging Face repository (the files an engine needs).

The agent's model cache (``fleetserve.agent.cache``: its ``download`` module) reads them, the
model facts and the Kubernetes renderer ask the same rule; nothing here opens a file or a socket.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from fleetserve.errors import SourceError


@dataclass(frozen=True)
class LocalSource:
    """A file on this machine."""

    path: Path


@dataclass(frozen=True)
class HttpSource:
    """An http(s) URL."""

    url: str


@dataclass(frozen=True)
class ControlPlaneSource:
    """The control plane's copy of a model: ``fleetserve://NAME``."""

    name: str


@dataclass(frozen=True)
class HfSource:
    """One file of a Hugging Face repository, at a revision (a branch, tag or commit; None = main)."""

    repo_id: str
    filename: str
    revision: str | None = None


@dataclass(frozen=True)
class HfRepoSource:
    """A whole Hugging Face repository at a revision (None = main): cached as one directory."""

    repo_id: str
    revision: str | None = None


@dataclass(frozen=True)
class HfRepo:
    """A Hugging Face repository, or one file of it, at a revision (None = main), as an engine
    that downloads by itself names it."""

    repo_id: str
    path: str = ""
    revision: str | None = None


def parse_hf_repo(source: str) -> HfRepo:
    """``hf://ORG/REPO[/PATH][@REV]`` → the repository, the path in it and the revision."""
    rest = source.strip().partition("://")[2]
    path, _, revision = rest.partition("@")
    segments = [s for s in path.split("/") if s]
    if len(segments) < 2:
        raise SourceError(f"{source}: expected hf://ORG/REPO[/FILE][@REVISION]")
    return HfRepo(f"{segments[0]}/{segments[1]}", "/".join(segments[2:]), revision or None)


Source = LocalSource | HttpSource | ControlPlaneSource | HfSource | HfRepoSource


def parse_source(source: str) -> Source:
    """The source a model's ``source`` string names; SourceError when it names none we can read."""
    text = source.strip()
    if not text:
        raise SourceError("the model has no source: set a local path, an http(s) URL, hf:// or fleetserve://")
    scheme, sep, rest = text.partition("://")
    if not sep:
        return LocalSource(Path(text))
    scheme = scheme.lower()
    if scheme == "file":
        parts = urlsplit(text)
        if parts.netloc not in ("", "localhost"):
            raise SourceError(f"{source}: file:// URLs must name a local file (file:///abs/path)")
        return LocalSource(Path(unquote(parts.path)))
    if scheme in ("http", "https"):
        if not urlsplit(text).netloc:
            raise SourceError(f"{source}: the URL has no host")
        return HttpSource(text)
    if scheme == "fleetserve":
        name = rest.strip("/")
        if not name or "/" in name:
            raise SourceError(f"{source}: expected fleetserve://MODEL-NAME")
        return ControlPlaneSource(name)
    if scheme == "hf":
        path, at, revision = rest.rpartition("@") if "@" in rest else (rest, "", "")
        segments = [s for s in path.split("/") if s]
        if len(segments) < 2 or (at and not revision) or any(s in (".", "..") for s in segments):
            raise SourceError(
                f"{source}: expected hf://ORG/REPO/PATH/IN/REPO[@REVISION] (one file, e.g. "
                "hf://org/repo/model.gguf@main) or hf://ORG/REPO[@REVISION] (a whole repository)"
            )
        if len(segments) == 2:
            return HfRepoSource(f"{segments[0]}/{segments[1]}", revision or None)
        return HfSource(f"{segments[0]}/{segments[1]}", "/".join(segments[2:]), revision or None)
    raise SourceError(
        f"{source}: unsupported source scheme {scheme!r}; use a local path, file://, http(s)://, "
        "hf:// or fleetserve://"
    )


def source_file_name(source: Source) -> str | None:
    """The file name the source suggests (its last path component), if any."""
    match source:
        case LocalSource(path):
            return path.name or None
        case HttpSource(url):
            name = unquote(urlsplit(url).path.rstrip("/").rpartition("/")[2])
            return name or None
        case HfSource(_, filename, _):
            return filename.rpartition("/")[2] or None
        case ControlPlaneSource() | HfRepoSource():
            return None
    return None  # pragma: no cover - the match is exhaustive
