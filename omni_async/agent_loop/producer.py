"""The trainer's handle on the one producer: the :class:`~omni_async.agent_loop.rollouter.Rollouter` and the agent
loop (``AgentLoopManager``) it runs on.

The rollouter's state belongs to the agent loop's thread (asyncio futures, the sampler, the live groups), so the
trainer never touches it: every method here is called from the trainer's thread, hops to the loop, and waits for the
answer. These are the only ways the trainer drives production: start, take, wait, publish a weights version, change
the settings (cap and lag bound), lend trainer ranks to generation, read metrics and the resume position, stop.
"""

from __future__ import annotations

from typing import Any

from omni_async.agent_loop.manager import AgentLoopManager
from omni_async.agent_loop.rollouter import DrawSource, Group, ProducerSettings, Rollouter


class Producer:
    def __init__(self, agent: AgentLoopManager, rollouter: Rollouter):
        self.agent = agent
        self.rollouter = rollouter  # lives on the agent loop: read or changed only through the methods below

    @classmethod
    def start(
        cls,
        agent: AgentLoopManager,
        draws: DrawSource,
        settings: ProducerSettings,
        *,
        groups_to_train: int,
        rollout_version: int,
        first_draw: int = 0,
        finished: dict[str, int] | None = None,
    ) -> Producer:
        """A rollouter made on the loop (its futures belong there) and started: it draws and starts groups from now
        on (``Rollouter``'s arguments)."""
        rollouter = agent.on_loop(
            lambda: Rollouter(
                agent,
                draws,
                settings,
                groups_to_train=groups_to_train,
                rollout_version=rollout_version,
                first_draw=first_draw,
                finished=finished,
            )
        )
        agent.call(rollouter.start())
        return cls(agent, rollouter)

    # ---- the groups -------------------------------------------------------------------------------------------
    def take(self, step: int, n: int, among: int | None = None) -> list[Group]:
        """Step ``step``'s next ``n`` scored groups (``Rollouter.take``); blocks until they are there."""
        return self.agent.call(self.rollouter.take(step, n, among))

    def sampleable(self, step: int) -> int:
        """Scored groups step ``step`` could take now."""
        return self.agent.on_loop(lambda: self.rollouter.sampleable(step))

    def wait_sampleable(self, step: int, k: int, take: int | None = None) -> int:
        """Block until step ``step`` could take ``k`` groups and, with ``take``, a take of that many would return
        (``Rollouter.ready``), or none can finish before the next sync; the count."""
        return self.agent.call(self.rollouter.wait_sampleable(step, k, take))

    def live_groups(self) -> int:
        """Groups started and not yet taken or dropped (generating or scored)."""
        return self.agent.on_loop(lambda: len(self.rollouter.live))

    # ---- the weights and the settings ----------------------------------------------------------------------------
    def quiesce(self) -> None:
        """Stop starting groups and wait until every started sample is generated (a sync that needs the rollout
        idle); :meth:`publish` starts production again."""
        self.agent.call(self.rollouter.quiesce())

    def publish(self, version: int) -> None:
        """The rollout workers hold weights ``version`` now: a new production window."""
        self.agent.call(self.rollouter.on_sync(version))

    def set_settings(self, settings: ProducerSettings) -> None:
        """Go on with another mode's cap, lag bound and take order (``Rollouter.apply``)."""
        self.agent.on_loop(lambda: self.rollouter.apply(settings))

    # ---- trainer ranks lent to generation (the disaggregated layout's switch) -----------------------------------
    def switch_inputs(self, step: int, take: int) -> tuple[int, int]:
        """What the switch decides on, read at one moment: groups step ``step`` can use for its next take of ``take``
        (``Rollouter.ready``), and samples waiting for a device (``AgentLoopManager.waiting_for_device``)."""
        return self.agent.on_loop(lambda: (self.rollouter.ready(step, take), self.agent.waiting_for_device()))

    def lend(self, ranks: list[Any]) -> None:
        """``ranks`` (trainer ranks, already serving) take generation requests beside the rollout workers."""
        self.agent.on_loop(lambda: self.agent.lend(ranks))

    def stop_lending(self) -> None:
        """No new request goes to a lent rank."""
        self.agent.on_loop(self.agent.stop_lending)

    # ---- what the trainer reads and keeps ----------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """The rollouter's counters (verl's fully async names)."""
        return self.agent.on_loop(self.rollouter.metrics)

    def position(self) -> dict[str, Any]:
        """What a checkpoint keeps to resume production (``Rollouter.position``)."""
        return self.agent.on_loop(self.rollouter.position)

    def stop(self) -> None:
        """Cancel production and the groups in flight."""
        self.agent.call(self.rollouter.stop())
