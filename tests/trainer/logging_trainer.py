"""``python tests/trainer/logging_trainer.py LOG OVERRIDES...``: the trainer's ``fit`` as ``python -m
omni_async.trainer.main`` runs it (``make_trainer``: offline Diffusion-DPO's trainer for an offline run), appending
``step uid index seed`` of every trained sample to LOG after each step (flushed), and sleeping ``SLOW_UPDATE_S``
seconds in each optimizer step; ``CONFIG_NAME`` picks the shipped config (default flowgrpo_trainer). A test kills
this process with SIGKILL; the run that resumes it is :func:`run`, in the test's own process (what a restarted
process does, without starting and importing a second interpreter).

``KILL_AT=<point>:<step>`` with ``KILL_READY=<file>`` stops the run at a named point of step ``<step>`` (0-based, as
``train_step`` counts), touches ``<file>`` and waits there for the test's SIGKILL, so the kill lands where the test
says, not where a timer happens to be:

- ``update``: inside the step's first optimizer step (the update half done: the step's groups drawn and scored);
- ``checkpoint``: inside the atomic write of the step's ``trainer.json`` (its actor files written, half of the
  marker's bytes in the temporary file, nothing renamed).

A kill mid reward is the reward function's: ``rewards_for_tests.blocks_after`` (``OMNI_ASYNC_TEST_KILL_*``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from omni_async.trainer import atomic_files, loop
from omni_async.trainer.config import compose
from omni_async.trainer.offline_trainer import make_trainer


def wait_for_kill(ready: str) -> None:
    Path(ready).touch()
    time.sleep(3600)


def run(
    log_path: str, overrides: list[str], config_name: str, kill_at: str = "", ready: str = "", slow: float = 0
) -> None:
    """The run ``main`` makes of its arguments and environment; a test calls it in its own process for a run that is
    not killed (``kill_at`` empty: nothing is patched beyond the trainer it builds)."""
    trainer = make_trainer(compose(overrides, config_name=config_name))
    point, _, at = kill_at.partition(":")
    real_step, real_train_step = trainer.ops.optimizer_step, trainer.train_step
    current = {"step": -1}

    def slow_step(minibatch, timer):
        if point == "update" and current["step"] == int(at):
            wait_for_kill(ready)
        time.sleep(slow)
        return real_step(minibatch, timer)

    def logged_train_step(step):
        current["step"] = step
        metrics, samples = real_train_step(step)
        with open(log_path, "a") as f:
            f.writelines(f"{step} {s.uid} {s.index} {s.seed}\n" for s in samples)
            f.flush()
            os.fsync(f.fileno())
        return metrics, samples

    def marker_write(path, text):  # the checkpoint of step k (0-based) is step_{k+1}'s trainer.json
        if Path(path).parent.name == f"step_{int(at) + 1:06d}":
            data = text.encode()
            atomic_files.write_atomic(
                path, lambda f: (f.write(data[: len(data) // 2]), f.flush(), wait_for_kill(ready))
            )
        atomic_files.write_text_atomic(path, text)

    trainer.ops.optimizer_step, trainer.train_step = slow_step, logged_train_step
    if point == "checkpoint":
        loop.write_text_atomic = marker_write
    trainer.fit()


def main() -> None:
    env = os.environ
    run(
        sys.argv[1],
        sys.argv[2:],
        env.get("CONFIG_NAME", "flowgrpo_trainer"),
        env.get("KILL_AT", ""),
        env.get("KILL_READY", ""),
        float(env.get("SLOW_UPDATE_S", "0")),
    )


if __name__ == "__main__":
    main()
