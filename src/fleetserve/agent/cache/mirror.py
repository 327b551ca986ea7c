"""An offline Hugging Face mirror: a local directory laid out as a hub cache, read, never downloaded.

``hf://`` sources are read from ``MIRROR/models--ORG--REPO/{blobs,snapshots,refs}`` when the agent
is given a mirror (``--hf-mirror``), resolved by ``huggingface_hub`` with ``local_files_only``: the
network is never asked. Without one they come from the Hub (``fleetserve.agent.cache.hub``).
"""

from __future__ import annotations

from pathlib import Path

from fleetserve.errors import SourceError
from fleetserve.sources import HfSource


def hf_mirror_file(mirror: Path, source: HfSource) -> Path:
    """The mirror's file for ``source``, resolved offline by ``huggingface_hub`` (never the network)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HFValidationError

    shown = f"hf://{source.repo_id}/{source.filename}" + (f"@{source.revision}" if source.revision else "")
    if not mirror.is_dir():
        raise SourceError(f"{shown}: the Hugging Face mirror directory {mirror} does not exist")
    try:
        found = hf_hub_download(
            source.repo_id,
            source.filename,
            revision=source.revision,
            cache_dir=mirror,
            local_files_only=True,
        )
    except (OSError, ValueError, HFValidationError) as exc:
        raise SourceError(
            f"{shown}: not found in the Hugging Face mirror {mirror} (offline: nothing is downloaded; "
            f"expected {mirror}/models--{source.repo_id.replace('/', '--')}/snapshots/<commit>/"
            f"{source.filename} with refs/{source.revision or 'main'} naming the commit): {exc}"
        ) from exc
    return Path(found)


def hf_mirror_repo(mirror: Path, repo_id: str, revision: str | None, allow: tuple[str, ...]) -> Path:
    """The mirror's snapshot directory of a whole repository (the ``allow`` files), offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    shown = f"hf://{repo_id}" + (f"@{revision}" if revision else "")
    if not mirror.is_dir():
        raise SourceError(f"{shown}: the Hugging Face mirror directory {mirror} does not exist")
    try:
        found = snapshot_download(
            repo_id, revision=revision, cache_dir=mirror, local_files_only=True, allow_patterns=list(allow)
        )
    except (OSError, ValueError, HFValidationError) as exc:
        raise SourceError(
            f"{shown}: not found in the Hugging Face mirror {mirror} (offline: nothing is downloaded; "
            f"expected {mirror}/models--{repo_id.replace('/', '--')}/snapshots/<commit>/ with "
            f"refs/{revision or 'main'} naming the commit): {exc}"
        ) from exc
    return Path(found)
