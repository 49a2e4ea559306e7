"""The rollout contract: what the agent loop asks of a rollout worker, whichever kind serves it.

Three kinds implement it: ``agent_loop.rollout_replica.RolloutReplica`` (the split and disaggregated layouts),
``trainer.actor_worker.ActorWorker`` (the hybrid layout: an actor rank generates with the model it trains) and the
benchmarks' stand-ins (``bench/stand_ins.py``). The two real kinds inherit :meth:`RolloutWorker.generate`, which hands
the request to their ``GenerationBatcher``; the rest of the contract is theirs.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from omni_async.agent_loop.batcher import Generation, GenerationBatcher
    from omni_async.sample import Result


class RolloutWorker(Protocol):
    batcher: GenerationBatcher

    async def generate(
        self,
        prompt: str,
        seed: int,
        window: tuple[int, int] | None,
        *,
        sampling: dict[str, Any] | None = None,
        version: int | None = None,
        resume: Result | None = None,
    ) -> Generation:
        """One sample (image + SDE-window latents and log-probs, or response tokens + log-probs), a pure function of
        (weights version, seed, window). ``sampling`` overrides the policy's sampling settings for this request
        (validation: ``rollout.val_kwargs``); ``version``: the weights version it is for (a lock-step draw's; None: the
        newest this worker has; ``GenerationBatcher``). With partial rollout a text response may come back unfinished
        (``result.unfinished``: newer weights arrived); the caller continues it with ``resume=result``: its tokens and
        their versions stay, new tokens follow on the newest weights."""
        return await self.batcher.submit(prompt, seed, window, sampling=sampling, version=version, resume=resume)

    async def generate_many(
        self, requests: list[tuple[str, int, tuple[int, int] | None, dict[str, Any]]]
    ) -> list[Generation | BaseException]:
        """Several ``(prompt, seed, window, options)`` requests in one call (the agent loop's ``coalesce``: its
        requests for this worker in one turn), each handed to the batcher in order as its own :meth:`generate` call
        would be, so they land in the same device batches; answered together, a failed request as its exception."""
        return list(
            await asyncio.gather(
                *(self.generate(prompt, seed, window, **options) for prompt, seed, window, options in requests),
                return_exceptions=True,
            )
        )

    def stats(self) -> dict[str, Any]:
        """Counters (``batch_sizes``, ``version``, ...); also the agent loop's liveness probe after a restart (an
        ``async def`` serves too: the caller awaits a Ray call either way)."""
        ...
