"""A timeline picture of a switch (issue 39): fully async on the disaggregated layout (1 rollout worker + 1 trainer
rank, tiny:sd3 32x32) with ``trainer.v1.separate_async.hybrid_rollout.enable_switch=true``, the rollout worker slowed
so each step waits for groups and the trainer rank lends a hand. Draws the steps' timelines (samples made on the
trainer device in red, the trainer's ``switch_*`` phases as lanes).

    .venv/bin/python bench/switch_timeline.py [--steps 3] [--rollout-delay 1.0] [--out docs/img/switch_timeline.png]

On CPU, for the picture, not for timings (the benchmark is ``bench/async_reward.py --hybrid-switch both``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rollout-delay", type=float, default=1.0, help="seconds added to each rollout device batch")
    p.add_argument("--out", type=Path, default=ROOT / "docs/img/switch_timeline.png")
    args = p.parse_args()

    import ray
    from helpers import SMALL_IMAGE_TRAINER, write_prompts

    from omni_async.cluster import shutdown_ray
    from omni_async.trainer.config import compose
    from omni_async.trainer.loop import RLTrainer
    from omni_async.trainer.timeline import draw_timeline

    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose(
            [
                f"data.train_files={write_prompts(Path(tmp) / 'train.jsonl', 16)}",
                f"trainer.run_dir={tmp}/run",
                *SMALL_IMAGE_TRAINER,
                "actor_rollout_ref.rollout.nnodes=1",
                "actor_rollout_ref.rollout.n_gpus_per_node=1",
                "trainer.use_v1=true",
                "trainer.v1.trainer_mode=separate_async",
                "trainer.v1.separate_async.parameter_sync_step=1",  # the measured runs' (verl-omni's default: 4)
                "trainer.v1.sampler.max_off_policy_strategy=wait",  # (verl-omni's default: drop)
                "trainer.v1.separate_async.hybrid_rollout.enable_switch=true",
                "async_training.staleness_threshold=1",
                f"rollout.total_rollout_steps={args.steps + 1}",
                "trainer.log_image_freq=-1",
                "trainer.log_timeline_freq=-1",
            ]
        )
        trainer = RLTrainer(cfg)
        try:
            trainer.sync_weights(0)
            delay = args.rollout_delay

            def slow(self):
                generate = self.batcher.generate
                self.batcher.generate = lambda *a, **k: (time.sleep(delay), generate(*a, **k))[1]

            ray.get(trainer.placement.rollout_workers[0].__ray_call__.remote(slow))
            records = []
            for step in range(args.steps):
                metrics, _ = trainer.train_step(step)
                records.append(trainer.last_timeline)
                print(
                    f"step {step}: {metrics['timing_s/step']:.2f} s, switch_wait {metrics['timing_s/switch_wait']:.2f} s, "
                    f"lent samples {metrics['separate_async/switch/lent_samples']:.0f}"
                )
        finally:
            trainer.close()
            shutdown_ray()
    # One picture of every step: their records merged on one clock (each step's lanes stacked).
    merged = {
        "step": f"1-{args.steps}",
        "t0": records[0]["t0"],
        "samples": [
            {**s, "index": k}  # one lane each, in request order
            for k, s in enumerate(sorted((s for r in records for s in r["samples"]), key=lambda s: s["requested"]))
        ],
        "trainer": [p for r in records for p in r["trainer"]],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print("written:", draw_timeline(merged, args.out))
    args.out.with_suffix(".json").write_text(json.dumps(merged))


if __name__ == "__main__":
    main()
