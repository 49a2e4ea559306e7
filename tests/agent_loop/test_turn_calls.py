"""``batching.TurnCalls``: the agent loop's and the reward dispatcher's calls coalesced per turn of the event loop
(no Ray: the "call" is a coroutine answering one item each)."""

from __future__ import annotations

import asyncio

import pytest

from omni_async.batching import TurnCalls


def test_a_turns_items_go_in_one_call_per_key_in_order_and_each_caller_gets_its_answer():
    sent: list[tuple[str, list[int]]] = []

    async def answer(key: str, items: list[int]) -> list[object]:
        await asyncio.sleep(0)
        return [ValueError(f"bad {i}") if i < 0 else (key, 10 * i) for i in items]

    def send(key: str, items: list[int]):
        sent.append((key, items))
        return answer(key, items)

    async def run():
        calls = TurnCalls(send)
        first = [calls.submit("a", 1), calls.submit("b", 2), calls.submit("a", 3), calls.submit("a", -1)]
        await asyncio.sleep(0)  # the turn ends: one call per key
        second = calls.submit("a", 4)  # a later turn: its own call
        got = await asyncio.gather(*first, second, return_exceptions=True)
        return got, calls

    got, calls = asyncio.run(run())
    assert sent == [("a", [1, 3, -1]), ("b", [2]), ("a", [4])]
    assert got[:3] + got[4:] == [("a", 10), ("b", 20), ("a", 30), ("a", 40)]
    assert isinstance(got[3], ValueError) and str(got[3]) == "bad -1"  # only its own caller sees it
    assert (calls.calls, calls.items) == (3, 5)


def test_a_failed_or_silent_call_raises_at_every_caller_and_a_silent_one_is_cancelled():
    cancelled: list[object] = []

    async def dies(items):
        raise ConnectionError("worker died")

    async def hangs(items):
        await asyncio.sleep(60)

    async def run(fn, timeout_s):
        calls = TurnCalls(lambda key, items: asyncio.ensure_future(fn(items)), timeout_s, cancelled.append)
        return await asyncio.gather(*(calls.submit(0, i) for i in range(3)), return_exceptions=True)

    died = asyncio.run(run(dies, None))
    assert all(isinstance(e, ConnectionError) for e in died) and not cancelled
    silent = asyncio.run(run(hangs, 0.01))
    assert all(isinstance(e, asyncio.TimeoutError) for e in silent) and len(cancelled) == 1


def test_a_caller_that_gave_up_leaves_the_others_their_answers():
    async def run():
        gate = asyncio.Event()

        async def answer(items):
            await gate.wait()
            return items

        calls = TurnCalls(lambda key, items: answer(items))
        a, b = calls.submit(0, "a"), calls.submit(0, "b")
        await asyncio.sleep(0)
        a.cancel()
        gate.set()
        return await b, a.cancelled()

    assert asyncio.run(run()) == ("b", True)


@pytest.mark.parametrize("n", [1, 5])
def test_a_call_that_cannot_be_made_fails_its_items(n):
    def send(key, items):
        raise TypeError("cannot pickle")

    async def run():
        calls = TurnCalls(send)
        return await asyncio.gather(*(calls.submit(0, i) for i in range(n)), return_exceptions=True)

    assert all(isinstance(e, TypeError) for e in asyncio.run(run()))
