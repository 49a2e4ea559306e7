"""Per-step metrics to the console (progress bar), ``{run_dir}/metrics.jsonl`` and tensorboard; sample grids."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

_CONSOLE_KEYS = ("critic/rewards/mean", "timing_s/step", "timing_s/gen", "timing_s/reward", "actor/pg_loss")


class MetricsLogger:
    def __init__(self, run_dir: str | Path, backends: list[str], total_steps: int, start_step: int = 0):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        unknown = set(backends) - {"console", "jsonl", "tensorboard"}
        if unknown:
            raise ValueError(f"trainer.logger: unknown backend(s) {sorted(unknown)}; use console, jsonl, tensorboard")
        self.jsonl = (self.run_dir / "metrics.jsonl").open("a") if "jsonl" in backends else None
        self.tb = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        self.bar = None
        if "console" in backends:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="flowgrpo", dynamic_ncols=True)

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


def save_sample_grid(path: str | Path, images: list[np.ndarray], captions: list[str], cols: int = 4,
                     max_images: int = 16) -> Path:
    """A PNG grid of uint8 images, each captioned (e.g. with its reward)."""
    images, captions = images[:max_images], captions[:max_images]
    h, w = images[0].shape[:2]
    cap_h = 14
    rows = (len(images) + cols - 1) // cols
    grid = Image.new("RGB", (cols * w, rows * (h + cap_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (img, cap) in enumerate(zip(images, captions, strict=True)):
        x, y = (i % cols) * w, (i // cols) * (h + cap_h)
        grid.paste(Image.fromarray(img), (x, y + cap_h))
        draw.text((x + 2, y + 1), cap[: max(4, w // 6)], fill="black")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path


def save_samples(out_dir: Path, step: int, samples) -> Path:
    """Images / video first frames: a PNG grid with their rewards. Text: a JSONL of prompt, response, reward."""
    labels = [f"{s.outcome.score:.3f}" if s.outcome.ok else s.outcome.status for s in samples]
    if "image" in samples[0].generated:
        images = [np.asarray(s.generated["image"]) for s in samples]
        images = [img[0] if img.ndim == 4 else img for img in images]
        return save_sample_grid(Path(out_dir) / f"step_{step:04d}.png", images, labels)
    path = Path(out_dir) / f"step_{step:04d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"uid": s.uid, "prompt": s.row.prompt, "response": s.generated["response"],
                                        "reward": label}) + "\n" for s, label in zip(samples, labels, strict=True)))
    return path
