"""rawasgi.disconnect: waiting for the client to leave, and work cancelled when it does."""

from __future__ import annotations

import asyncio

import pytest

from fleetserve.rawasgi.disconnect import ClientGone, unless_gone, until_disconnect
from fleetserve.rawasgi.types import Message


class Client:
    """A receive() whose client sends the given events and then disconnects when told."""

    def __init__(self, *before: Message) -> None:
        self.before = list(before)
        self.left = asyncio.Event()
        self.calls = 0

    async def __call__(self) -> Message:
        self.calls += 1
        if self.before:
            return self.before.pop(0)
        await self.left.wait()
        return {"type": "http.disconnect"}


def test_waiting_for_the_disconnect_skips_what_comes_before_it() -> None:
    async def scenario() -> int:
        client = Client({"type": "http.request", "body": b"x", "more_body": False})
        waiting = asyncio.ensure_future(until_disconnect(client))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        client.left.set()
        await asyncio.wait_for(waiting, 1)
        return client.calls

    assert asyncio.run(scenario()) == 2


def test_work_that_finishes_first_returns_its_result_and_stops_the_watch() -> None:
    async def scenario() -> tuple[str, int]:
        client = Client()

        async def work() -> str:
            await asyncio.sleep(0)
            return "done"

        result = await unless_gone(client, work())
        await asyncio.sleep(0.01)
        client.left.set()  # a disconnect after the work cancels nothing
        await asyncio.sleep(0.01)
        return result, client.calls

    assert asyncio.run(scenario()) == ("done", 1)


def test_a_client_that_leaves_first_cancels_the_work_and_raises_client_gone() -> None:
    cleaned: list[str] = []

    async def scenario() -> None:
        client = Client()

        async def work() -> str:
            try:
                await asyncio.sleep(30)
            finally:
                cleaned.append("upstream closed")
            return "never"

        asyncio.get_running_loop().call_later(0.01, client.left.set)
        with pytest.raises(ClientGone):
            await unless_gone(client, work())
        # The task is not left cancelled: it goes on to answer its bookkeeping.
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert cleaned == ["upstream closed"]


def test_a_cancellation_not_the_clients_propagates_as_a_cancellation() -> None:
    async def scenario() -> None:
        client = Client()

        async def request() -> None:
            await unless_gone(client, asyncio.sleep(30))

        task = asyncio.ensure_future(request())
        await asyncio.sleep(0.01)
        task.cancel()  # the server stopping, not the client leaving
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())


def test_an_error_of_the_work_propagates_unchanged() -> None:
    async def scenario() -> None:
        async def work() -> None:
            raise LookupError("the work's own")

        with pytest.raises(LookupError, match="the work's own"):
            await unless_gone(Client(), work())

    asyncio.run(scenario())
