"""``trainer.group_order`` in process, on real device threads: a follower runs its group calls and the generation
batches its leader announces in the leader's order, however the trainer's calls and the announcements arrive."""

from __future__ import annotations

import asyncio
import random

import pytest

from omni_async.agent_loop.batcher import DeviceThread
from omni_async.trainer.group_order import Alone, Follower, Leader


class Handle:
    """A follower's Ray handle as the leader holds it: ``follow.remote`` arrives later, in a shuffled order."""

    def __init__(self, follower: Follower, loop: asyncio.AbstractEventLoop, rng: random.Random):
        self.follow = self
        self.follower, self.loop, self.rng = follower, loop, rng

    def remote(self, seq, key, payload) -> None:  # called on the leader's device thread
        delay = self.rng.uniform(0.0, 0.02)
        self.loop.call_soon_threadsafe(self.loop.call_later, delay, self.follower.follow, seq, key, payload)


def test_a_follower_runs_the_leaders_order_whatever_the_arrival_order():
    async def main() -> tuple[list, list, list]:
        loop, rng = asyncio.get_running_loop(), random.Random(0)
        logs: dict[str, list] = {"leader": [], "follower": []}
        devices = [DeviceThread("leader"), DeviceThread("follower")]
        follower = Follower(devices[1], lambda payload: logs["follower"].append(("generate", payload)))
        leader = Leader(devices[0], [Handle(follower, loop, rng)])

        def call(rank: str, name: str):
            def fn(arg):
                logs[rank].append((name, arg))
                return (rank, name, arg)

            return fn

        def generate(i: int) -> None:  # the leader's batcher starting a batch on its device thread
            leader.announce_generation(i)
            logs["leader"].append(("generate", i))

        # The trainer's calls: per name in one order on both ranks, across names in a different order per rank;
        # generation batches only on the leader, between them.
        calls = [(name, i) for i in range(6) for name in ("update", "sync", "log_prob")]
        futures = {"leader": [], "follower": []}
        for n, (name, i) in enumerate(calls):
            futures["leader"].append(leader.submit(name, call("leader", name), i))
            if n % 4 == 0:
                devices[0].submit(generate, n)
        # the follower gets every update first, then the syncs, then the log-prob calls
        for name, i in sorted(calls, key=lambda c: ({"update": 0, "sync": 1, "log_prob": 2}[c[0]], c[1])):
            await asyncio.sleep(rng.uniform(0.0, 0.003))
            futures["follower"].append(follower.submit(name, call("follower", name), i))
        results = await asyncio.wait_for(asyncio.gather(*futures["leader"], *futures["follower"]), timeout=30)
        for d in devices:
            d.shutdown(wait=True)
        return logs["leader"], logs["follower"], results

    leader_log, follower_log, results = asyncio.run(main())
    assert len(leader_log) == 18 + 5 and follower_log == leader_log
    assert sorted(r[1:] for r in results if r[0] == "follower") == sorted(r[1:] for r in results if r[0] == "leader")


def test_a_call_the_leader_has_not_run_waits_and_a_follower_cannot_start_a_batch():
    async def main() -> None:
        device = DeviceThread("follower")
        follower = Follower(device, lambda payload: None)
        ran: list[str] = []
        later = follower.submit("update", ran.append, "update")
        follower.follow(1, ("sync", 0), None)  # announced out of turn: waits for announcement 0 as well
        sync = follower.submit("sync", ran.append, "sync")
        await asyncio.sleep(0.05)
        assert ran == [] and not later.done() and not sync.done()
        follower.follow(0, ("update", 0), None)
        await asyncio.wait_for(asyncio.gather(later, sync), timeout=10)
        assert ran == ["update", "sync"]
        with pytest.raises(RuntimeError, match="generates only the batches its leader announces"):
            follower.announce_generation(None)
        device.shutdown(wait=True)

    asyncio.run(main())


def test_alone_runs_calls_in_arrival_order():
    async def main() -> list[int]:
        device, ran = DeviceThread("alone"), []
        alone = Alone(device)
        await asyncio.gather(*(alone.submit("update", ran.append, i) for i in range(5)))
        alone.announce_generation(None)  # nobody to tell
        device.shutdown(wait=True)
        return ran

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]
