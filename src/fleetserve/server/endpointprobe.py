"""The control plane's health checks of Endpoints (servers fleetserve did not start): every few
seconds, ``GET healthPath`` (``/v1/models`` unless the Endpoint says otherwise) with its key, and
the verdict recorded in the store, where every gateway's routes and ``fleetserve get endpoints``
read it.

An Endpoint is Ready while its check answers 2xx within ``CHECK_TIMEOUT``; anything else (no
connection, no answer in time, another status, a key file that cannot be read) makes it NotReady,
with what failed as its last error. The error names the status or failure, never the answer's
body nor the key. The request is built by the gateway's own ``upstream_request``: the same URL
rule, base path and key header as what it relays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime

from starlette.concurrency import run_in_threadpool

from fleetserve.endpointkeys import EndpointKeys, KeyUnreadable
from fleetserve.errors import FleetserveError
from fleetserve.gateway.picker import Endpoint as Upstream
from fleetserve.gateway.upstream import Call, upstream_request
from fleetserve.httpclient import HttpClient, UpstreamError
from fleetserve.spec.endpoint import Endpoint, EndpointState, upstream_id
from fleetserve.store.protocols import EndpointHealth

log = logging.getLogger("fleetserve.endpoints")

CHECK_SECONDS = 5.0
"""How often each Endpoint is checked."""

CHECK_TIMEOUT = 5.0
"""How long a check waits for the answer's status line."""


def verdict(status: int | None, failure: str | None, path: str) -> tuple[EndpointState, str | None]:
    """What a check's outcome makes the Endpoint: Ready on 2xx, else NotReady with why."""
    if failure is not None:
        return EndpointState.NOT_READY, failure
    if status is not None and 200 <= status < 300:
        return EndpointState.READY, None
    hint = " (is keyFile its key?)" if status in (401, 403) else ""
    return EndpointState.NOT_READY, f"GET {path} answered {status}{hint}"


class EndpointProber:
    """Checks every stored Endpoint's health and records it."""

    def __init__(
        self,
        store: EndpointHealth,
        keys: EndpointKeys,
        interval: float = CHECK_SECONDS,
        timeout: float = CHECK_TIMEOUT,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.store = store
        self.keys = keys
        self.interval = interval
        self.timeout = timeout
        self.clock = clock

    async def check(self, http: HttpClient, endpoint: Endpoint) -> tuple[EndpointState, str | None]:
        """One check of ``endpoint``: its state and last error."""
        key = self.keys.read(endpoint.key_file)
        if isinstance(key, KeyUnreadable):
            return EndpointState.NOT_READY, key.reason
        upstream = Upstream(upstream_id(endpoint.name), endpoint.url, endpoint.weight, key)
        call = Call(b"GET", endpoint.health_path.encode("ascii"), body=False)
        try:
            origin, request = upstream_request(upstream, call, b"")
            response = await asyncio.wait_for(http.request(origin, request, self.timeout), self.timeout * 2)
        except (UpstreamError, TimeoutError) as exc:
            return verdict(
                None, f"GET {endpoint.health_path}: {type(exc).__name__}: {exc}", endpoint.health_path
            )
        try:
            status = response.status
        finally:
            response.close()
        return verdict(status, None, endpoint.health_path)

    async def check_all(self, http: HttpClient) -> dict[str, tuple[EndpointState, str | None]]:
        """Check every stored Endpoint at once and record each verdict; the verdicts by name."""
        stored = await run_in_threadpool(self.store.list_endpoints)
        verdicts = await asyncio.gather(*(self.check(http, s.endpoint) for s in stored))
        now = self.clock()
        out: dict[str, tuple[EndpointState, str | None]] = {}
        for s, (state, error) in zip(stored, verdicts, strict=True):
            out[s.endpoint.name] = (state, error)
            if state is not s.state:
                log.info("endpoint %s: %s%s", s.endpoint.name, state.value, f" ({error})" if error else "")
            await run_in_threadpool(
                self.store.set_endpoint_health, s.endpoint.name, s.endpoint, state, error, now
            )
        return out

    async def run(self, stop: asyncio.Event) -> None:
        """Check every ``interval`` until ``stop`` is set."""
        http = HttpClient(connect_timeout=self.timeout)
        try:
            while not stop.is_set():
                try:
                    await self.check_all(http)
                except FleetserveError as exc:
                    log.warning("checking the endpoints failed: %s", exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=self.interval)
        finally:
            await http.aclose()
