"""Entry point: ``python -m omni_async.trainer.main [hydra overrides...]`` (config ``flowgrpo_trainer``)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig


@hydra.main(config_path="../config", config_name="flowgrpo_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    from omni_async.cluster import shutdown_ray, tune_driver_gc
    from omni_async.logs import setup_logging
    from omni_async.trainer.config_schema import typed
    from omni_async.trainer.loop import RLTrainer

    cfg = typed(cfg)
    setup_logging(cfg.trainer.log_level)  # before anything logs; init_ray hands the level to the Ray workers
    try:
        trainer = RLTrainer(cfg)
        tune_driver_gc()
        run_dir = trainer.fit()
        print(f"run directory: {run_dir.resolve()}  (metrics.jsonl, samples/, tensorboard/, checkpoints/)")
    finally:
        shutdown_ray()


if __name__ == "__main__":
    main()
