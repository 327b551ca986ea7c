"""A running replica's LoRA adapters: which it has loaded, and loading or unloading the ones its
deployment added or dropped while it runs, where its engine can (``AdapterSupport.live``: vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``), restarting nothing.

An engine that loads adapters only at start never gets here: its adapters are part of the
deployment's revision, so a change starts new replicas (a rollout). An engine the supervisor
restarted comes back with the adapters of its argv only; the next sync loads the rest again.

``changes`` is the pure decision; ``AdapterSync`` does the calls, one replica at a time on a thread
of its own, and fetches each adapter into the node's cache first (pinned while loaded).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from fleetserve.engines.launch import url_host
from fleetserve.engines.registry import ENGINES
from fleetserve.engines.spec import EngineKind
from fleetserve.routing import engine_auth
from fleetserve.spec.resources import Model

log = logging.getLogger("fleetserve.agent")

# How long one load or unload call may take (vLLM reads the adapter's files from the cache).
CALL_TIMEOUT = 60.0


def changes(loaded: Sequence[str], wanted: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(to load, in the deployment's order; to unload, in load order) to go from ``loaded`` to
    ``wanted``."""
    return tuple(n for n in wanted if n not in loaded), tuple(n for n in loaded if n not in wanted)


@dataclass
class Loaded:
    """One replica's adapters: those on its engine's argv, those it has loaded now (in load
    order), and the supervisor's restart count they were loaded under."""

    launched: tuple[str, ...]
    now: list[str]
    restarts: int = 0


@dataclass
class AdapterSync:
    """Keeps each running replica's loaded adapters as its assignment lists them, where its
    engine loads them at run time."""

    # The adapter's files in the node's cache, fetched (and pinned) first; and its unpinning.
    fetch: Callable[[Model], Path]
    release: Callable[[str], None]
    host: str
    _loaded: dict[str, Loaded] = field(default_factory=dict)
    _busy: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def started(self, replica: str, names: Sequence[str]) -> None:
        """A replica's engine was started with ``names`` on its argv."""
        with self._lock:
            self._loaded[replica] = Loaded(tuple(names), list(names))

    def stopped(self, replica: str) -> tuple[str, ...]:
        """Forget a stopped replica; the adapters it held (to unpin)."""
        with self._lock:
            gone = self._loaded.pop(replica, None)
        return tuple(gone.now) if gone is not None else ()

    def loaded(self, replica: str) -> list[str] | None:
        """The adapters ``replica`` has loaded now, in load order; None where it serves none."""
        with self._lock:
            held = self._loaded.get(replica)
            return list(held.now) if held is not None and held.now else None

    def sync(
        self,
        replica: str,
        engine: EngineKind,
        wanted: Sequence[Model],
        port: int,
        restarts: int,
        key: str | None,
    ) -> None:
        """Start loading and unloading what ``replica`` lacks or no longer lists, on a thread of
        its own (none when nothing changes, the engine cannot, or one runs for it already)."""
        support = ENGINES[engine].adapters
        if support is None or not support.live or not port:
            return
        with self._lock:
            held = self._loaded.get(replica)
            if held is None or replica in self._busy:
                return
            if restarts != held.restarts:  # a restarted engine holds its argv's adapters only
                for name in held.now:
                    if name not in held.launched:
                        self.release(name)
                held.now, held.restarts = list(held.launched), restarts
            add, drop = changes(held.now, [m.name for m in wanted])
            if not add and not drop:
                return
            self._busy.add(replica)
        base = f"http://{url_host(self.host)}:{port}"
        models = {m.name: m for m in wanted}
        threading.Thread(
            target=self._apply,
            args=(replica, base, support.load_path, support.unload_path, [models[n] for n in add], drop, key),
            name=f"adapters-{replica}",
            daemon=True,
        ).start()

    def _apply(
        self,
        replica: str,
        base: str,
        load_path: str,
        unload_path: str,
        add: list[Model],
        drop: tuple[str, ...],
        key: str | None,
    ) -> None:
        try:
            with httpx.Client(timeout=CALL_TIMEOUT, headers=engine_auth(key)) as http:
                for name in drop:
                    response = http.post(f"{base}{unload_path}", json={"lora_name": name})
                    if response.status_code >= 400:
                        log.warning(
                            "replica %s: unloading adapter %s: %s", replica, name, response.text[:500]
                        )
                        continue
                    with self._lock:
                        held = self._loaded.get(replica)
                        if held is not None and name in held.now:
                            held.now.remove(name)
                    self.release(name)
                    log.info("replica %s: unloaded adapter %s", replica, name)
                for model in add:
                    path = self.fetch(model)
                    response = http.post(
                        f"{base}{load_path}", json={"lora_name": model.name, "lora_path": str(path)}
                    )
                    if response.status_code >= 400:
                        self.release(model.name)
                        log.warning(
                            "replica %s: loading adapter %s: %s", replica, model.name, response.text[:500]
                        )
                        continue
                    with self._lock:
                        held = self._loaded.get(replica)
                        if held is None:  # stopped meanwhile
                            self.release(model.name)
                            continue
                        held.now.append(model.name)
                    log.info("replica %s: loaded adapter %s at run time", replica, model.name)
        except Exception as exc:  # a failed call is retried at the next sync; never kills the agent
            log.warning("replica %s: syncing adapters failed: %s", replica, exc)
        finally:
            with self._lock:
                self._busy.discard(replica)
