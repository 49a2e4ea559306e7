"""What keeps the driver's CPU per sample low (``bench/driver_cost.py``), without Ray: ``batching.TurnCalls`` (the
agent loop's and the reward dispatcher's calls coalesced per turn of the event loop; the "call" is a coroutine
answering one item each) and an ``ImageResult``'s wire form."""

from __future__ import annotations

import asyncio
from functools import partial

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


def test_a_keys_items_go_in_calls_of_at_most_max_items_in_order():
    """``max_items`` (the agent loop: a rollout worker's device batch): a call answers when its last item is done, so
    a turn's requests beyond one batch go in further calls instead of waiting for the later batch."""
    sent: list[list[int]] = []

    def send(key, items):
        sent.append(list(items))
        return asyncio.sleep(0, [10 * i for i in items])

    async def run():
        calls = TurnCalls(send, max_items=2)
        return await asyncio.gather(*(calls.submit("w", i) for i in range(5)))

    assert asyncio.run(run()) == [0, 10, 20, 30, 40] and sent == [[0, 1], [2, 3], [4]]


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


def test_a_ray_call_is_answered_through_its_concurrent_future_from_another_thread():
    """A Ray ``ObjectRef`` (here a stand-in with its ``future()``) is not awaited by a task: its concurrent future,
    completed on another thread (Ray's io thread), hands each item its answer on the loop; an error reaches every
    caller; past the deadline the call is cancelled once and its items time out, and the late answer changes nothing."""
    import concurrent.futures
    import threading

    class Ref:
        def __init__(self, answer: object, after_s: float):
            self.cf: concurrent.futures.Future = concurrent.futures.Future()
            setter = self.cf.set_exception if isinstance(answer, BaseException) else self.cf.set_result
            threading.Timer(after_s, setter, (answer,)).start()

        def future(self) -> concurrent.futures.Future:
            return self.cf

    cancelled: list[object] = []

    async def run(answer, after_s: float, timeout_s: float | None):
        calls = TurnCalls(lambda key, items: Ref(answer(items), after_s), timeout_s, cancelled.append)
        got = await asyncio.gather(*(calls.submit(0, i) for i in range(3)), return_exceptions=True)
        await asyncio.sleep(2 * after_s)  # a late answer arrives meanwhile
        return got

    assert asyncio.run(run(lambda items: [10 * i for i in items], 0.01, 5.0)) == [0, 10, 20]
    died = asyncio.run(run(lambda items: ConnectionError("worker died"), 0.01, None))
    assert all(isinstance(e, ConnectionError) for e in died) and not cancelled
    late = asyncio.run(run(lambda items: list(items), 0.05, 0.01))
    assert all(isinstance(e, asyncio.TimeoutError) for e in late) and len(cancelled) == 1


@pytest.mark.parametrize("n", [1, 5])
def test_a_call_that_cannot_be_made_fails_its_items(n):
    def send(key, items):
        raise TypeError("cannot pickle")

    async def run():
        calls = TurnCalls(send)
        return await asyncio.gather(*(calls.submit(0, i) for i in range(n)), return_exceptions=True)

    assert all(isinstance(e, TypeError) for e in asyncio.run(run()))


def test_an_image_result_travels_as_numpy_arrays_and_comes_back_equal_and_writable():
    """A rollout worker's answer (``ImageResult``) pickles its tensors as numpy arrays, not with torch's reducers (a
    ``torch.save`` each: the driver's largest cost per answer); every field comes back equal, dtypes included
    (bfloat16 has no numpy type), and the tensors are the driver's own (writable), not views of Ray's buffer."""
    import pickle

    import numpy as np
    import torch

    from omni_async.sample import ImageResult

    sent = ImageResult(
        np.arange(48, dtype=np.uint8).reshape(4, 4, 3),
        torch.randn(3, 2, 4).to(torch.bfloat16),
        torch.randn(2, dtype=torch.float64),
        {"prompt_embeds": torch.randn(5, 4), "mask": torch.tensor([1, 1, 0])},
        window_start=2,
        window_means=torch.randn(4, 3).t(),  # not contiguous
    )
    buffers: list[pickle.PickleBuffer] = []
    wire = pickle.dumps(sent, protocol=5, buffer_callback=buffers.append)  # as Ray pickles: arrays out of band
    assert b"_rebuild_tensor" not in wire and b"torch._utils" not in wire and len(buffers) >= 5
    received = [bytes(b.raw()) for b in buffers]  # read-only, as Ray hands them over
    got = pickle.loads(wire, buffers=received)
    for name in ("window_latents", "log_probs", "window_means"):
        a, b = getattr(sent, name), getattr(got, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got.conditioning.keys() == sent.conditioning.keys()
    assert all(torch.equal(got.conditioning[k], v) for k, v in sent.conditioning.items())
    assert np.array_equal(got.pixels, sent.pixels) and got.window_start == 2 and got.latents_clean is None
    for t in (got.window_latents, got.log_probs, got.window_means, *got.conditioning.values()):
        t.add_(1)  # the driver's own memory: Ray's buffers stay as received
    assert received == [bytes(b.raw()) for b in buffers]


def test_the_reward_samples_of_one_turn_share_one_call_to_one_worker_while_it_has_room():
    """The dispatcher sends the samples leaving its queue in one turn to one worker (one ``score_many`` call) up to
    ``max_inflight_per_worker``, the rest to the next least loaded; each sample gets its own outcome."""
    from omni_async.reward.dispatcher import RewardDispatcher
    from omni_async.sample import RewardOutcome

    calls: list[tuple[int, list[str]]] = []

    class Worker:
        def __init__(self, i: int):
            self.i = i
            self.score_many = self  # handle.score_many.remote(records)

        def remote(self, records):
            calls.append((self.i, [r["uid"] for r in records]))
            return asyncio.sleep(0, [RewardOutcome("ok", score=float(r["uid"])) for r in records])

    async def run():
        d = RewardDispatcher([Worker(0), Worker(1)], queue_size=16, max_inflight_per_worker=3, timeout_s=5)
        return await asyncio.gather(*(d.score({"uid": str(i)}) for i in range(5)))

    outcomes = asyncio.run(run())
    assert [o.score for o in outcomes] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert calls == [(0, ["0", "1", "2"]), (1, ["3", "4"])]


def test_lingering_items_of_several_turns_share_a_call_until_the_earliest_deadline_or_one_that_does_not_linger():
    """``submit(..., linger_s)`` (``reward.linger_ms``): items of later turns join the waiting ones (one call per
    key); an item with ``linger_s=0`` sends all of them at the end of its turn; otherwise the earliest of the waiting
    items' deadlines does."""
    sent: list[tuple[str, list[int]]] = []

    def send(key, items):
        sent.append((key, list(items)))
        return asyncio.sleep(0, [10 * i for i in items])

    async def run():
        calls = TurnCalls(send)
        waiting = [calls.submit("w", 1, 60.0)]
        await asyncio.sleep(0)
        waiting += [calls.submit("w", 2, 60.0), calls.submit("v", 3, 60.0)]
        await asyncio.sleep(0)
        assert sent == []  # two turns later, still lingering
        waiting.append(calls.submit("w", 4))
        assert sent == []  # the end of this turn, not at once
        await asyncio.sleep(0)
        assert sent == [("w", [1, 2, 4]), ("v", [3])]
        assert await asyncio.gather(*waiting) == [10, 20, 30, 40]
        late = [calls.submit("w", 5, 60.0), calls.submit("w", 6, 0.01)]  # the second's deadline comes first
        await asyncio.sleep(0)
        assert len(sent) == 2  # waits for its timer
        return await asyncio.gather(*late)

    assert asyncio.run(run()) == [50, 60] and sent[-1] == ("w", [5, 6])


def test_reward_samples_linger_for_one_call_while_more_are_generating():
    """The dispatcher with ``linger_s``: samples leaving the queue in different turns go to the same worker in one
    call while ``more_coming()`` (the agent loop's requests out); the sample that finds nothing more coming sends
    them at once. A sample lingers at most ``LINGER_SHARE`` of its generation's time."""
    from omni_async.reward.dispatcher import RewardDispatcher

    calls: list[tuple[int, list[str]]] = []
    Worker = partial(RecordingWorker, calls=calls)

    async def run():
        d = RewardDispatcher([Worker(0), Worker(1)], queue_size=16, max_inflight_per_worker=8, timeout_s=5, linger_s=60)
        generating = [True]
        d.more_coming = lambda: generating[0]
        tasks = [asyncio.ensure_future(d.score({"uid": "0"}))]
        for i in (1, 2):
            await asyncio.sleep(0.001)
            tasks.append(asyncio.ensure_future(d.score({"uid": str(i)})))
        await asyncio.sleep(0.001)
        assert calls == []
        generating[0] = False
        tasks.append(asyncio.ensure_future(d.score({"uid": "3"})))
        return await asyncio.gather(*tasks)

    assert [o.score for o in asyncio.run(run())] == [0.0, 1.0, 2.0, 3.0]
    assert calls == [(0, ["0", "1", "2", "3"])]

    from omni_async.reward.dispatcher import LINGER_SHARE
    from omni_async.sample import SampleTimes

    d = RewardDispatcher([Worker(0)], queue_size=4, max_inflight_per_worker=4, timeout_s=5, linger_s=0.2)
    fast, slow = SampleTimes(gen_start=10.0, gen_end=10.5), SampleTimes(gen_start=0.0, gen_end=60.0)
    assert d._linger_s(fast) == pytest.approx(LINGER_SHARE * 0.5) and d._linger_s(slow) == 0.2
    d.more_coming = lambda: False
    assert d._linger_s(slow) == 0.0


def test_a_short_linger_window_keeps_its_worker_only_that_long():
    """A sample of a fast generation lingers ``LINGER_SHARE`` of its generation time, and the worker its window chose
    is kept only that long: the next sample, after the window, goes to the least loaded worker again (scoring stays
    spread across the workers, not on one for ``reward.linger_ms``)."""
    from omni_async.reward.dispatcher import RewardDispatcher
    from omni_async.sample import SampleTimes

    calls: list[tuple[int, list[str]]] = []
    SlowWorker = partial(RecordingWorker, calls=calls, delay_s=0.05)

    async def run():
        d = RewardDispatcher([SlowWorker(0), SlowWorker(1)], queue_size=8, max_inflight_per_worker=8, timeout_s=5)
        d.linger_s, d.more_coming = 60.0, lambda: True
        fast = SampleTimes(gen_start=0.0, gen_end=0.02)  # lingers 2 ms
        first = asyncio.ensure_future(d.score({"uid": "0"}, fast))
        await asyncio.sleep(0.01)  # its window has ended and its call is out (scoring: 50 ms)
        second = asyncio.ensure_future(d.score({"uid": "1"}, fast))
        return await asyncio.gather(first, second)

    asyncio.run(run())
    assert calls == [(0, ["0"]), (1, ["1"])]  # a 60 s window would have kept worker 0 for the second


class RecordingWorker:
    """A reward-loop worker's ``score_many.remote`` for the dispatcher: records ``(worker, uids)`` per call and
    answers each record with its uid as the score after ``delay_s``."""

    def __init__(self, i: int, calls: list[tuple[int, list[str]]], delay_s: float = 0.0):
        self.i, self.calls, self.delay_s = i, calls, delay_s
        self.score_many = self

    def remote(self, records):
        from omni_async.sample import RewardOutcome

        self.calls.append((self.i, [r["uid"] for r in records]))
        return asyncio.sleep(self.delay_s, [RewardOutcome("ok", score=float(r["uid"])) for r in records])


def test_a_generation_answer_that_may_linger_waits_in_the_hold_for_the_lingering_reward_call():
    """``AnswerHold``: a generation answer arriving on another thread (Ray's io thread) while a reward call lingers
    does not wake the loop if its own items may linger past that call's deadline: it is handed out just before the
    call goes, and its reward item joins it (one call, as if handed out at once). An answer whose items may linger
    less than the time left, or one with no call lingering, is handed out at once."""
    import concurrent.futures
    import threading

    from omni_async.batching import AnswerHold

    class Ref:  # a Ray ObjectRef's future(), answered from another thread after ``after_s``
        def __init__(self, items: list[int], after_s: float):
            self.cf: concurrent.futures.Future = concurrent.futures.Future()
            threading.Timer(after_s, self.cf.set_result, ([10 * i for i in items],)).start()

        def future(self) -> concurrent.futures.Future:
            return self.cf

    scored: list[list[int]] = []

    def score(key, items):
        scored.append(list(items))
        return asyncio.sleep(0, list(items))

    async def run(linger_of_answer: float, window_s: float | None) -> tuple[bool, int]:
        hold = AnswerHold()
        rewards = TurnCalls(score, hold=hold)
        generation = TurnCalls(lambda key, items: Ref(items, 0.02), hold=hold, linger_of=lambda a: linger_of_answer)
        first = rewards.submit(0, 1, window_s) if window_s is not None else None
        answer = generation.submit(0, 2)
        await asyncio.sleep(0.08)  # the answer has arrived (20 ms); the reward window (if any) is still open
        at_once = answer.done()
        second = rewards.submit(0, await answer, 60.0 if first is not None else 0.0)
        await asyncio.gather(*(f for f in (first, second) if f is not None))
        return at_once, hold.held

    assert asyncio.run(run(60.0, 0.3)) == (False, 1) and scored == [[1, 20]]  # kept, then one call
    scored.clear()
    assert asyncio.run(run(0.01, 0.3)) == (True, 0) and scored == [[1, 20]]  # its deadline first: at once
    scored.clear()
    assert asyncio.run(run(60.0, None)) == (True, 0) and scored == [[20]]  # nothing lingers: at once


def test_a_kept_answers_reward_samples_join_the_windows_worker():
    """The dispatcher's linger window ends (its worker is let go) only after the answers kept for it are handed out,
    so their samples go to the window's worker in its call, not to the least loaded worker in a second one."""
    from omni_async.reward.dispatcher import RewardDispatcher

    calls: list[tuple[int, list[str]]] = []
    Worker = partial(RecordingWorker, calls=calls)

    async def run():
        d = RewardDispatcher(
            [Worker(0), Worker(1)], queue_size=8, max_inflight_per_worker=8, timeout_s=5, linger_s=0.05
        )
        d.more_coming = lambda: True
        later: list[asyncio.Future] = []
        first = asyncio.ensure_future(d.score({"uid": "0"}))
        await asyncio.sleep(0.01)  # its window (worker 0, 50 ms) is open
        loop = asyncio.get_running_loop()
        kept = d.hold.offer(loop.time(), 1.0, 1, lambda: later.append(asyncio.ensure_future(d.score({"uid": "1"}))))
        await asyncio.sleep(0.1)
        return kept, await asyncio.gather(first, *later)

    kept, outcomes = asyncio.run(run())
    assert kept and [o.score for o in outcomes] == [0.0, 1.0]
    assert calls == [(0, ["0", "1"])]  # without the hold's settle at the window's end: (0, ["0"]), (1, ["1"])
