"""A stand-in for ``python`` under an example script: ``-m omni_async.trainer.main <overrides>`` composes and
validates the config the script would run and prints it as JSON, instead of training; anything else (the data
preparation scripts) runs for real."""

from __future__ import annotations

import json
import runpy
import sys

from omegaconf import OmegaConf

if sys.argv[1:3] == ["-m", "omni_async.trainer.main"]:
    from omni_async.trainer.config import compose, validate

    config_name, overrides = "flowgrpo_trainer", []
    args = iter(sys.argv[3:])
    for arg in args:
        if arg == "--config-name":
            config_name = next(args)
        elif arg.startswith("--config-name="):
            config_name = arg.split("=", 1)[1]
        elif not arg.startswith("hydra."):
            overrides.append(arg)
    cfg = validate(compose(overrides, config_name=config_name))
    print(json.dumps(OmegaConf.to_container(cfg, resolve=True)))
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
