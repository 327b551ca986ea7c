"""The Hugging Face Hub as a model source, through ``huggingface_hub``: what to download, and where.

``resolve`` asks the Hub (``HfApi.model_info`` with ``files_metadata``: ``GET
/api/models/ORG/REPO/revision/REV?blobs=true``) for the commit a revision names and the files at
that commit with their digests (the sha256 of LFS files, the git blob id of the others). Every
later request names that commit, never the branch: a revision is pinned to the commit the Hub
resolved once. ``locate`` asks ``get_hf_file_metadata`` (``HEAD /ORG/REPO/resolve/COMMIT/FILE``,
following redirects only on the Hub) where the bytes are (the Hub, or a CDN it redirects to) and
which headers to send there (the token never leaves the Hub). The bytes themselves are moved by
``fleetserve.agent.cache.transfer``: resumable across attempts and restarts, hashed as they pass.

The endpoint is ``HF_ENDPOINT`` (or the public Hub), the token ``HF_TOKEN`` or the agent's
``--hf-token-file``: never a command-line argument. Gated, private, missing repositories, revisions
and files are SourceErrors that name the repository and the fix.

A whole repository (``hf://ORG/REPO``) is the files an engine needs (``ALLOW_PATTERNS``: weights in
safetensors, config, generation config, tokenizer files, a PEFT adapter's config), at the top level
of the repository.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from fleetserve.errors import SourceError

# The files of a repository an engine (vLLM) needs; top-level names only.
ALLOW_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    # A PEFT LoRA adapter's (``kind: Adapter``, format peft): beside adapter_model.safetensors.
    "adapter_config.json",
    "chat_template.json",
)
TOKEN_HELP = "set HF_TOKEN in the agent's environment or start it with --hf-token-file FILE"


@dataclass(frozen=True)
class HubAccess:
    """How this agent reaches the Hub: the endpoint (None = HF_ENDPOINT or the public Hub), and the
    token (None = HF_TOKEN or huggingface_hub's stored token)."""

    endpoint: str | None = None
    token: str | None = None

    @classmethod
    def from_environment(cls, token_file: Path | None = None) -> HubAccess:
        """HF_ENDPOINT and HF_TOKEN as this process sees them, the token file first when given."""
        token = None
        if token_file is not None:
            try:
                token = token_file.read_text(encoding="utf-8").strip() or None
            except OSError as exc:
                raise SourceError(f"cannot read the Hugging Face token file {token_file}: {exc}") from exc
        return cls(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)

    def base(self) -> str:
        """The endpoint requests go to."""
        from huggingface_hub import constants

        return (self.endpoint or constants.ENDPOINT).rstrip("/")


@dataclass(frozen=True)
class HubFile:
    """One file of a repository at a commit: its path, size and the Hub's digest of it."""

    name: str
    size: int | None
    sha256: str | None  # LFS files: the sha256 of the content
    blob_id: str | None  # files in git: the git blob id (sha1 of "blob <size>\\0" + content)

    def verify(self, sha256: str, path: Path) -> str | None:
        """Why the bytes at ``path`` (whose sha256 is given) are not this file, or None."""
        if self.sha256 is not None:
            return None if sha256 == self.sha256 else f"the Hub's sha256 is {self.sha256}, got {sha256}"
        if self.blob_id is not None:
            got = git_blob_id(path)
            return None if got == self.blob_id else f"the Hub's git blob id is {self.blob_id}, got {got}"
        return None


@dataclass(frozen=True)
class HubSnapshot:
    """A repository at the commit a revision resolved to, with the files to download."""

    repo_id: str
    revision: str | None
    commit: str
    files: tuple[HubFile, ...]

    def source(self, filename: str | None = None) -> str:
        """The pinned source string: ``hf://ORG/REPO[/FILE]@COMMIT``."""
        return f"hf://{self.repo_id}" + (f"/{filename}" if filename else "") + f"@{self.commit}"


def shown(repo_id: str, filename: str | None, revision: str | None) -> str:
    """A source as the user wrote it."""
    return f"hf://{repo_id}" + (f"/{filename}" if filename else "") + (f"@{revision}" if revision else "")


def git_blob_id(path: Path) -> str:
    """The git blob id of a file (sha1 over ``blob <size>\\0`` and the content)."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def wanted(name: str) -> bool:
    """Whether a repository file is one an engine needs (``ALLOW_PATTERNS``, top level)."""
    return "/" not in name and any(fnmatch.fnmatchcase(name, p) for p in ALLOW_PATTERNS)


def resolve(access: HubAccess, repo_id: str, revision: str | None, filename: str | None) -> HubSnapshot:
    """The commit ``revision`` names and the files to fetch: ``filename``, or the repository's
    engine files when None. SourceError names the repository and the fix."""
    from huggingface_hub import HfApi

    what = shown(repo_id, filename, revision)
    try:
        info = HfApi(endpoint=access.base(), token=access.token).model_info(
            repo_id, revision=revision, files_metadata=True
        )
    except _client_errors() as exc:
        raise hub_error(exc, what, repo_id, revision) from exc
    if not info.sha:
        raise SourceError(f"{what}: the Hub at {access.base()} did not name the commit of the revision")
    siblings = {s.rfilename: s for s in info.siblings or []}
    if filename is not None:
        names = [filename]
        if filename not in siblings:
            listing = ", ".join(sorted(siblings)[:20]) or "none"
            raise SourceError(
                f"{what}: the repository {repo_id} has no file {filename!r} at commit {info.sha} "
                f"(revision {revision or 'main'}); its files: {listing}"
            )
    else:
        names = sorted(n for n in siblings if wanted(n))
        if not any(n.endswith(".safetensors") for n in names):
            raise SourceError(
                f"{what}: the repository {repo_id} has no safetensors weights at commit {info.sha}; a whole "
                "repository is served as safetensors (for one GGUF file name it: hf://ORG/REPO/FILE.gguf)"
            )
    files = []
    for name in names:
        sibling = siblings[name]
        lfs = sibling.lfs
        files.append(
            HubFile(
                name=name,
                size=lfs.size if lfs is not None else sibling.size,
                sha256=lfs.sha256 if lfs is not None else None,
                blob_id=None if lfs is not None else sibling.blob_id,
            )
        )
    return HubSnapshot(repo_id, revision, info.sha, tuple(files))


def locate(access: HubAccess, snapshot: HubSnapshot, file: HubFile) -> tuple[str, dict[str, str]]:
    """Where the bytes of ``file`` are (the Hub, or the CDN it redirects to) and the headers to send."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils._headers import build_hf_headers

    url = hf_hub_url(snapshot.repo_id, file.name, revision=snapshot.commit, endpoint=access.base())
    what = snapshot.source(file.name)
    try:
        meta = get_hf_file_metadata(url, token=access.token, endpoint=access.base(), retry_on_errors=True)
    except _client_errors() as exc:
        raise hub_error(exc, what, snapshot.repo_id, snapshot.revision) from exc
    if meta.commit_hash is not None and meta.commit_hash != snapshot.commit:
        raise SourceError(f"{what}: the Hub answered for commit {meta.commit_hash}, not {snapshot.commit}")
    location = meta.location or url
    headers = build_hf_headers(token=access.token)
    if _origin(location) != _origin(url):
        headers.pop("authorization", None)  # a signed CDN URL: the token stays on the Hub
    return location, headers


def _client_errors() -> tuple[type[BaseException], ...]:
    """What ``huggingface_hub`` raises for an answer or a connection it could not use."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError

    return (HfHubHTTPError, httpx2.HTTPError, OSError, ValueError)


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc


def hub_error(exc: BaseException, what: str, repo_id: str, revision: str | None) -> SourceError:
    """Our SourceError for what ``huggingface_hub`` raised, naming the repository and the fix."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, SourceError):
        return exc
    if isinstance(exc, GatedRepoError):
        return SourceError(
            f"{what}: the repository {repo_id} is gated: accept its conditions on "
            f"https://huggingface.co/{repo_id} with your account, then give the agent a token of that "
            f"account ({TOKEN_HELP})"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return SourceError(
            f"{what}: the repository {repo_id} does not exist or is private: check its name, or give the "
            f"agent a token that may read it ({TOKEN_HELP})"
        )
    if isinstance(exc, RevisionNotFoundError):
        return SourceError(
            f"{what}: the repository {repo_id} has no revision {revision or 'main'!r}: name an existing "
            "branch, tag or commit after @"
        )
    if isinstance(exc, EntryNotFoundError | RemoteEntryNotFoundError):
        return SourceError(f"{what}: no such file in the repository {repo_id}")
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "?"
        if status in (401, 403):
            return SourceError(f"{what}: the Hub refused access to {repo_id} (HTTP {status}): {TOKEN_HELP}")
        return SourceError(f"{what}: the Hub answered HTTP {status}: {str(exc).splitlines()[0]}")
    return SourceError(f"{what}: cannot reach the Hub: {type(exc).__name__}: {exc}")
