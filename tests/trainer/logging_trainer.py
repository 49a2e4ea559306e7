"""``python tests/trainer/logging_trainer.py LOG OVERRIDES...``: the trainer's ``fit`` as ``python -m
omni_async.trainer.main`` runs it, appending ``step uid index seed`` of every trained sample to LOG after each step
(flushed), and sleeping ``SLOW_UPDATE_S`` seconds in each optimizer step; ``CONFIG_NAME`` picks the shipped config
(default flowgrpo_trainer). A test kills this process with SIGKILL."""

from __future__ import annotations

import os
import sys
import time

from omni_async.trainer.config import compose
from omni_async.trainer.loop import RLTrainer


def main() -> None:
    log_path, overrides = sys.argv[1], sys.argv[2:]
    trainer = RLTrainer(compose(overrides, config_name=os.environ.get("CONFIG_NAME", "flowgrpo_trainer")))
    slow = float(os.environ.get("SLOW_UPDATE_S", "0"))
    real_step, real_train_step = trainer.ops.optimizer_step, trainer.train_step

    def slow_step(minibatch, timer):
        time.sleep(slow)
        return real_step(minibatch, timer)

    def logged_train_step(step):
        metrics, samples = real_train_step(step)
        with open(log_path, "a") as f:
            f.writelines(f"{step} {s.uid} {s.index} {s.seed}\n" for s in samples)
            f.flush()
            os.fsync(f.fileno())
        return metrics, samples

    trainer.ops.optimizer_step, trainer.train_step = slow_step, logged_train_step
    trainer.fit()


if __name__ == "__main__":
    main()
