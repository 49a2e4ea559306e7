"""Per-step metrics to the console (progress bar), ``{run_dir}/metrics.jsonl`` and tensorboard.

On resume from step ``s``, rows of ``metrics.jsonl`` for steps after ``s`` (written by the run that died after its
last checkpoint) are dropped first, so each step has exactly one row.
"""

from __future__ import annotations

import json
from pathlib import Path

_CONSOLE_KEYS = ("critic/rewards/mean", "timing_s/step", "timing_s/gen", "timing_s/reward", "actor/pg_loss")


class MetricsLogger:
    def __init__(self, run_dir: str | Path, backends: list[str], total_steps: int, start_step: int = 0,
                 label: str = "train"):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        unknown = set(backends) - {"console", "jsonl", "tensorboard"}
        if unknown:
            raise ValueError(f"trainer.logger: unknown backend(s) {sorted(unknown)}; use console, jsonl, tensorboard")
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

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.jsonl:
            self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self.jsonl.flush()
        if self.tb:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.bar:
            self.bar.set_postfix({k.split("/")[-1] if k != "timing_s/step" else "step_s": f"{metrics[k]:.3g}"
                                  for k in _CONSOLE_KEYS if k in metrics})
            self.bar.update(1)

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.bar:
            self.bar.close()


def _drop_rows_after(path: Path, step: int) -> None:
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in rows if json.loads(line).get("step", 0) <= step]
    if len(kept) != len(rows):
        path.write_text("".join(line + "\n" for line in kept))
