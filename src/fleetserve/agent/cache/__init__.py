"""The node agent's model cache: content-addressed, verified, resumable, bounded.

One concern per module; imports point down this list, never up::

    modelcache.py  ModelCache: what the cache holds, lookups, pins, one download per model: the
                   API the agent runtime and ``fleetserve up`` call
    download.py    Downloader: which transfer each source gets (a local file, http(s),
                   fleetserve://, the Hub, an offline mirror), the ONE resume-and-retry loop,
                   free disk, digests
    hub.py         the Hugging Face Hub through ``huggingface_hub``: a revision pinned to its
                   commit, each file's digest, where its bytes are
    mirror.py      an offline hub-cache directory, read through ``huggingface_hub``
    transfer.py    bytes into a part file, hashed as they pass: a copy, a resumable HTTP GET
    layout.py      Layout: the directories, content addressing, 0700 folders, atomic moves, the
                   sweep after a crash
    refs.py        Ref: one model's record on disk (``refs/<model>.json``)
    eviction.py    plan_eviction: which models to evict to fit a budget; pure, no disk
    progress.py    Meter: a download's throttled progress and live status; ``rich`` bars
    status.py      CacheState, ModelStatus, CachedModel, ProgressCallback: what callers are told

The types callers need are importable from here.
"""

from fleetserve.agent.cache.hub import HubAccess
from fleetserve.agent.cache.modelcache import ModelCache
from fleetserve.agent.cache.status import CachedModel, CacheState, ModelStatus, ProgressCallback

__all__ = ["CacheState", "CachedModel", "HubAccess", "ModelCache", "ModelStatus", "ProgressCallback"]
