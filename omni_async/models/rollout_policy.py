"""What a rollout worker asks of a policy: one ``generate`` for every policy, and ``generate_stream`` for those that
batch continuously.

The rollout worker (``agent_loop.rollout_replica.RolloutReplica``, or a hybrid / lent trainer rank in
``trainer.actor_worker``) hands its ``agent_loop.batcher.GenerationBatcher`` the policy's ``generate`` and, where
:attr:`RolloutPolicy.continuous_batching` says so, its ``generate_stream``. The policies declare which they are
(``DiffusionPolicy``: device batches of denoising steps; ``TextPolicy`` and the simulated device built on it: a
response joins and leaves the decoding batch between tokens; ``VLLMTextPolicy``: the server batches), so the worker
is wired from a declared property rather than by probing for a method.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from omni_async.sample import Result


class RolloutPolicy(Protocol):
    continuous_batching: ClassVar[bool]

    def generate(
        self,
        prompts: list[str],
        seeds: list[int],
        windows: list[range] | None = None,
        *,
        sampling: dict[str, Any] | None = None,
        resume: list[Any] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Result]:
        """One result per ``(prompt, seed)``, in order. ``windows``: each sample's SDE window (image policies);
        ``sampling``: settings that differ from the policy's own for these samples (validation's);
        ``resume``: interrupted responses to continue (text, partial rollout); ``should_stop()``: asked after each
        token, once true the batch returns its unfinished responses (text). A policy refuses, naming why, an
        argument that does not apply to it."""
        ...

    def generate_stream(
        self,
        admit: Callable[[int], list[tuple[Any, str, int, Any]]],
        emit: Callable[[Any, Result], None],
        *,
        capacity: int,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        """Continuous batching, called only where :attr:`continuous_batching` is true: ``admit(free)`` gives new
        requests ``(key, prompt, seed, resume)`` between tokens, ``emit(key, result)`` answers each as it ends."""
        ...


def refuse_inapplicable(policy: str, **given: Any) -> None:
    """Raise ``ValueError`` naming the ``generate`` arguments given (not ``None``) that ``policy`` cannot honour."""
    named = sorted(k for k, v in given.items() if v is not None)
    if named:
        raise ValueError(f"{policy}.generate does not take {', '.join(named)} (see models.rollout_policy)")
