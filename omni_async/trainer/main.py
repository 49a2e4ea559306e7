"""Entry point: ``python -m omni_async.trainer.main [hydra overrides...]`` (config ``flowgrpo_trainer``)."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig


@hydra.main(config_path="../config", config_name="flowgrpo_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    from omni_async.cluster import shutdown_ray, tune_driver_gc
    from omni_async.config.schema import typed
    from omni_async.logs import setup_logging
    from omni_async.trainer.offline_trainer import make_trainer
    from omni_async.trainer.profiling import rerun_under_nsys

    cfg = typed(cfg)
    setup_logging(cfg.trainer.log_level)  # before anything logs; init_ray hands the level to the Ray workers
    # global_profiler.tool=nsys: this process is verl's controller; it runs again under nsys' controller options
    rerun_under_nsys(cfg, sys.argv)
    try:
        trainer = make_trainer(cfg)  # RLTrainer, or offline DPO's without rollout and reward
        tune_driver_gc()
        run_dir = trainer.fit()
        print(f"run directory: {run_dir.resolve()}  (metrics.jsonl, samples/, tensorboard/, checkpoints/)")
    finally:
        shutdown_ray()


# Hydra's flags that take the next argument as their value
_VALUE_FLAGS = ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd", "--cfg", "-c", "--package", "-p")
_VALUE_FLAGS += ("--experimental-rerun",)


def checked_argv(argv: list[str]) -> list[str]:
    """``argv`` with its overrides checked before Hydra sees them (``overrides.check_overrides``: upstream keys
    renamed or accepted, unknown and refused keys raised together, naming each key and the fix, instead of Hydra's
    ``Could not override``). Hydra's own flags and ``hydra.*`` overrides pass unchanged."""
    from omni_async.config.overrides import check_overrides

    flags, overrides, config_name = [], [], "flowgrpo_trainer"
    args = iter(argv[1:])
    for arg in args:
        if arg in _VALUE_FLAGS:
            value = next(args, "")
            config_name = value if arg in ("--config-name", "-cn") else config_name
            flags += [arg, value]
        elif arg.startswith("-"):
            if arg.startswith("--config-name="):
                config_name = arg.split("=", 1)[1]
            flags.append(arg)
        else:
            overrides.append(arg)
    return [argv[0], *flags, *check_overrides(overrides, config_name)]


if __name__ == "__main__":
    import gc

    # Imports and the trainer's build with the cyclic collector off, as in the Ray workers
    # (cluster.pause_gc_while_importing); tune_driver_gc turns it back on once the trainer is built.
    gc.disable()
    from omni_async.config_error import ConfigError

    try:
        sys.argv = checked_argv(sys.argv)
    except ConfigError as err:
        sys.exit(f"config error: {err}")
    main()
