"""The client's disconnect: waiting for it, and cancelling work when it comes first.

Once a request's body is read, ASGI's ``receive()`` has nothing left to give but
``http.disconnect``, which it returns when the client closes the connection. A handler that waits
on something slow (an upstream engine, a held poll) watches for it, so the work stops with its
client instead of running for nobody.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fleetserve.errors import FleetserveError, InternalError
from fleetserve.rawasgi.types import Receive

T = TypeVar("T")


class ClientGone(FleetserveError):
    """The client disconnected before its answer was ready; the work for it was cancelled."""


async def until_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (events before it, such as a body, are dropped)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work`` and return its result; if the client disconnects first, cancel it and
    raise ``ClientGone``.

    Run it in the request's own task (the task is what is cancelled, so ``work``'s cleanup,
    such as closing an upstream request, runs). A cancellation from elsewhere (the server
    stopping) is not the client's and propagates as ``CancelledError``."""
    task = asyncio.current_task()
    if task is None:
        raise InternalError("unless_gone runs in a task")
    watch = asyncio.ensure_future(until_disconnect(receive))
    finished = False

    def gone(done: asyncio.Future[None]) -> None:
        if not finished and not done.cancelled() and done.exception() is None:
            task.cancel()

    watch.add_done_callback(gone)
    try:
        return await work
    except asyncio.CancelledError:
        if watch.done() and not finished:
            task.uncancel()
            raise ClientGone() from None
        raise
    finally:
        finished = True
        if not watch.done():
            watch.cancel()
