"""Per-step metrics to the console (progress bar), ``{run_dir}/metrics.jsonl``, tensorboard and wandb.

wandb (``trainer.logger`` containing ``wandb``) is imported only when listed; the run goes to project
``trainer.project_name``, named ``trainer.experiment_name``, with its files under ``{run_dir}/wandb``.

On resume from step ``s``, rows of ``metrics.jsonl`` for steps after ``s`` (written by the run that died after its
last checkpoint) are dropped first, so each step has exactly one row.
"""

from __future__ import annotations

import json
from pathlib import Path

from omni_async.trainer.reward_plot import plot_reward

_CONSOLE_KEYS = ("critic/rewards/mean", "timing_s/step", "timing_s/gen", "timing_s/reward", "actor/pg_loss")


class MetricsLogger:
    def __init__(self, run_dir: str | Path, backends: list[str], total_steps: int, start_step: int = 0,
                 label: str = "train", project: str = "omni_async", config: dict | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        unknown = set(backends) - {"console", "jsonl", "tensorboard", "wandb"}
        if unknown:
            raise ValueError(f"trainer.logger: unknown backend(s) {sorted(unknown)}; use console, jsonl, tensorboard, "
                             "wandb")
        self.wandb = None
        if "wandb" in backends:
            try:
                import wandb
            except ImportError:
                raise ValueError("trainer.logger lists wandb, which is not installed. Fix: pip install wandb, or "
                                 "remove wandb from trainer.logger") from None
            self.wandb = wandb.init(project=project, name=label, dir=str(self.run_dir), config=config or {})
        self.jsonl = None
        if "jsonl" in backends:
            path = self.run_dir / "metrics.jsonl"
            _drop_rows_after(path, start_step)
            self.jsonl = path.open("a")
        self.tb = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        self.bar = None
        if "console" in backends:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc=label, dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float], advance: bool = True) -> None:
        """One row of ``metrics`` at ``step``; ``advance=False`` (validation before training) leaves the progress
        bar where it is."""
        if self.wandb:
            self.wandb.log(metrics, step=step)
        if self.jsonl:
            self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self.jsonl.flush()
        if self.tb:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.bar and advance:
            self.bar.set_postfix({k.split("/")[-1] if k != "timing_s/step" else "step_s": f"{metrics[k]:.3g}"
                                  for k in _CONSOLE_KEYS if k in metrics})
            self.bar.update(1)

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
            plot_reward(self.run_dir)  # {run_dir}/plots/reward.png, the whole run's curve (resumed steps too)
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
        if self.bar:
            self.bar.close()


def _drop_rows_after(path: Path, step: int) -> None:
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in rows if json.loads(line).get("step", 0) <= step]
    if len(kept) != len(rows):
        path.write_text("".join(line + "\n" for line in kept))
