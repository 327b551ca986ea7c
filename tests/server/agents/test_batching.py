"""``server/agents/batching.py``: concurrent calls gathered into one worker-thread call at a time."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest

from fleetserve.errors import StoreError
from fleetserve.server.agents.batching import Gather


class Doubler:
    """A many-at-once function that records its batches; the first batch waits for ``release``."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.batches: list[list[int]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail_on = fail_on

    def __call__(self, arguments: Sequence[int]) -> list[int]:
        self.batches.append(list(arguments))
        if len(self.batches) == 1:
            self.entered.set()
            assert self.release.wait(10)
        if self.fail_on in arguments:
            raise StoreError("the database went away")
        return [2 * a for a in arguments]


async def first_in_flight(gather: Gather[int, int], many: Doubler) -> asyncio.Task[int]:
    first = asyncio.create_task(gather(1))
    await asyncio.to_thread(many.entered.wait, 10)
    return first


def test_a_lone_call_runs_at_once_and_calls_made_meanwhile_share_the_next_batch() -> None:
    async def main() -> None:
        many = Doubler()
        gather: Gather[int, int] = Gather(many)
        first = await first_in_flight(gather, many)
        rest = [asyncio.create_task(gather(n)) for n in range(2, 7)]
        await asyncio.sleep(0.05)
        assert many.batches == [[1]]  # the first did not wait for company; the rest wait for it
        many.release.set()
        assert await first == 2
        assert await asyncio.gather(*rest) == [4, 6, 8, 10, 12]
        assert many.batches == [[1], [2, 3, 4, 5, 6]]
        assert (gather.batches, gather.calls) == (2, 6)

    asyncio.run(main())


def test_a_batch_holds_at_most_limit_calls() -> None:
    async def main() -> None:
        many = Doubler()
        gather: Gather[int, int] = Gather(many, limit=2)
        first = await first_in_flight(gather, many)
        rest = [asyncio.create_task(gather(n)) for n in range(2, 7)]
        await asyncio.sleep(0.01)
        many.release.set()
        assert [await first, *await asyncio.gather(*rest)] == [2, 4, 6, 8, 10, 12]
        assert many.batches == [[1], [2, 3], [4, 5], [6]]

    asyncio.run(main())
    with pytest.raises(ValueError, match="limit=0"):
        Gather(Doubler(), limit=0)


def test_an_error_of_a_batch_is_each_of_its_callers_error_and_the_next_batch_runs() -> None:
    async def main() -> None:
        many = Doubler(fail_on=3)
        gather: Gather[int, int] = Gather(many)
        first = await first_in_flight(gather, many)
        second = [asyncio.create_task(gather(n)) for n in (2, 3)]
        await asyncio.sleep(0.01)
        many.release.set()
        assert await first == 2
        for task in second:
            with pytest.raises(StoreError):
                await task
        assert await gather(4) == 8  # the next batch runs as if nothing happened

    asyncio.run(main())


def test_a_caller_that_goes_away_takes_nothing_with_it() -> None:
    async def main() -> None:
        many = Doubler()
        gather: Gather[int, int] = Gather(many)
        first = await first_in_flight(gather, many)
        leaving, staying = asyncio.create_task(gather(2)), asyncio.create_task(gather(3))
        await asyncio.sleep(0.01)
        leaving.cancel()
        many.release.set()
        assert await first == 2 and await staying == 6
        assert leaving.cancelled()

    asyncio.run(main())


def test_a_wrong_number_of_results_is_every_callers_error() -> None:
    async def main() -> None:
        gather: Gather[int, int] = Gather(lambda arguments: [0])
        results = await asyncio.gather(gather(1), gather(2), return_exceptions=True)
        assert all(isinstance(r, RuntimeError) and "1 results for a batch of 2" in str(r) for r in results)

    asyncio.run(main())


def test_with_a_tick_the_first_call_waits_for_the_calls_of_its_tick() -> None:
    async def main() -> None:
        many = Doubler()
        many.release.set()
        gather: Gather[int, int] = Gather(many, tick=0.05)
        # Made one after another, each within the first's tick: one batch, the first in it.
        first = asyncio.create_task(gather(1))
        await asyncio.sleep(0)
        rest = [asyncio.create_task(gather(n)) for n in range(2, 5)]
        assert [await first, *await asyncio.gather(*rest)] == [2, 4, 6, 8]
        assert many.batches == [[1, 2, 3, 4]]
        # A batch full before its tick ends is still one batch, at most ``limit`` calls.
        small: Gather[int, int] = Gather(many, limit=2, tick=0.05)
        assert await asyncio.gather(*(small(n) for n in (5, 6, 7))) == [10, 12, 14]
        assert many.batches[1:] == [[5, 6], [7]]

    asyncio.run(main())
    for tick in (-0.1, 1.5):
        with pytest.raises(ValueError, match=f"tick={tick}"):
            Gather(Doubler(), tick=tick)
