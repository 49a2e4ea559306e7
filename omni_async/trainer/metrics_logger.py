"""Per-step metrics: ``{run_dir}/metrics.jsonl`` (always) and verl's ``Tracking`` for ``trainer.logger``.

``trainer.logger`` takes verl's backend names (``console``, ``wandb``, ``tensorboard``, ``mlflow``, ``file``,
``swanlab``, ``clearml``, ``trackio``, ...) and hands them to ``verl.utils.tracking.Tracking`` unchanged, so a
verl script's ``trainer.logger=[console,wandb]`` logs as it does in verl (project ``trainer.project_name``, run
``trainer.experiment_name``). Where verl writes into the current directory, the run directory is used unless the
user's environment says otherwise: tensorboard to ``{run_dir}/tensorboard`` (``TENSORBOARD_DIR``), verl's ``file``
backend to ``{run_dir}/tracking.jsonl`` (``VERL_FILE_LOGGER_PATH``), wandb's files to ``{run_dir}/wandb``
(``WANDB_DIR``).

``metrics.jsonl`` (one flat JSON object per step, with ``step``) is the project's own record: the reward plot,
the benchmarks and resume read it. ``jsonl`` in ``trainer.logger`` (the name of earlier releases) is accepted and
means this file, which is written in any case. On resume from step ``s``, its rows for steps after ``s`` (written
by the run that died after its last checkpoint) are dropped first, so each step has exactly one row.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path

from omni_async.trainer.atomic_files import write_text_atomic
from omni_async.trainer.reward_plot import plot_reward

log = logging.getLogger(__name__)

LEGACY_JSONL = "jsonl"  # earlier releases' backend name for metrics.jsonl, which is now always written
_PROGRESS_KEYS = ("critic/rewards/mean", "timing_s/step", "timing_s/gen", "timing_s/reward", "actor/pg_loss")


def tracking_backends(backends: list[str]) -> list[str]:
    """The entries of ``trainer.logger`` that go to verl's ``Tracking``."""
    return [b for b in backends if b != LEGACY_JSONL]


@contextmanager
def _default_env(defaults: dict[str, str]):
    """Set environment variables the user has not set, only while verl's loggers read them at construction."""
    added = [k for k in defaults if k not in os.environ]
    for k in added:
        os.environ[k] = defaults[k]
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


class MetricsLogger:
    def __init__(
        self,
        run_dir: str | Path,
        backends: list[str],
        total_steps: int,
        start_step: int = 0,
        label: str = "train",
        project: str = "omni_async",
        config: dict | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        _drop_rows_after(path, start_step)
        self.jsonl = path.open("a")
        self.tracking = None
        if backends := tracking_backends(list(backends)):
            from verl.utils.tracking import Tracking

            env = {
                "TENSORBOARD_DIR": str(self.run_dir / "tensorboard"),
                "VERL_FILE_LOGGER_PATH": str(self.run_dir / "tracking.jsonl"),
                "WANDB_DIR": str(self.run_dir),
            }
            with _default_env(env):
                self.tracking = Tracking(
                    project_name=project, experiment_name=label, default_backend=backends, config=config
                )
        from tqdm import tqdm

        # A progress bar on a terminal only (disable=None): in logs verl's console lines say the same.
        self.bar = tqdm(total=total_steps, initial=start_step, desc=label, dynamic_ncols=True, disable=None)

    def log(self, step: int, metrics: dict[str, float], advance: bool = True) -> None:
        """One row of ``metrics`` at ``step``; ``advance=False`` (validation before training) leaves the progress
        bar where it is."""
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        if self.tracking is not None:
            self.tracking.log(data=metrics, step=step)
        if advance:
            self.bar.set_postfix(
                {
                    k.split("/")[-1] if k != "timing_s/step" else "step_s": f"{metrics[k]:.3g}"
                    for k in _PROGRESS_KEYS
                    if k in metrics
                }
            )
            self.bar.update(1)

    def close(self) -> None:
        self.jsonl.close()
        plot_reward(self.run_dir)  # {run_dir}/plots/reward.png, the whole run's curve (resumed steps too)
        if self.tracking is not None:
            self.tracking.finish()
        self.bar.close()


def _drop_rows_after(path: Path, step: int) -> None:
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in rows if json.loads(line).get("step", 0) <= step]
    if len(kept) != len(rows):
        log.info("resuming at step %d: dropping %d metrics.jsonl row(s) of later steps", step, len(rows) - len(kept))
        write_text_atomic(path, "".join(line + "\n" for line in kept))
