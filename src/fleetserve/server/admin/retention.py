"""How long the control plane keeps the gateways' usage and the audit log, and the task that drops
what is older: at start, then every ``PRUNE_SECONDS``. Every server may run it (deleting rows older
than a bound is idempotent), so no leader is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from starlette.concurrency import run_in_threadpool

from fleetserve.errors import FleetserveError
from fleetserve.store.protocols import Retention

log = logging.getLogger("fleetserve.server.admin.retention")

# Seconds between two prunings.
PRUNE_SECONDS = 3600.0


@dataclass(frozen=True)
class RetentionPolicy:
    """How long usage rows and audit events are kept."""

    usage: timedelta = timedelta(days=30)
    audit: timedelta = timedelta(days=365)

    def __post_init__(self) -> None:
        for name, value in (("usage", self.usage), ("audit", self.audit)):
            if value <= timedelta(0):
                raise ValueError(f"the {name} retention must be positive, got {value}")


def prune_once(store: Retention, policy: RetentionPolicy, now: datetime) -> tuple[int, int]:
    """Drop usage older than ``now - policy.usage`` and events older than ``now - policy.audit``;
    how many of each went."""
    return store.prune_usage(now - policy.usage), store.prune_events(now - policy.audit)


async def prune_forever(
    store: Retention, policy: RetentionPolicy, stop: asyncio.Event, interval: float = PRUNE_SECONDS
) -> None:
    """Prune at once, then every ``interval`` seconds until ``stop`` is set; a failure is logged
    and tried again next time."""
    while not stop.is_set():
        try:
            usage, events = await run_in_threadpool(prune_once, store, policy, datetime.now(UTC))
        except FleetserveError as exc:
            log.warning("pruning usage and audit events failed: %s", exc)
        else:
            if usage or events:
                log.info("pruned %d usage rows and %d audit events past their retention", usage, events)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)
