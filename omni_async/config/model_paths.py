"""Model paths checked at start, on the driver, before Ray starts: a typo in ``model.path`` costs a second, not a
cluster start and diffusers' ValueError from inside a Ray actor half a minute later.

A path resolves when it is a ``tiny:<name>`` this project builds, a local directory, or a Hugging Face hub id
(``org/name``) that is in this machine's hub cache or, with the hub reachable, exists there (users with hub access
give ``Qwen/Qwen-Image``). Loading (and downloading) stays where it is; this only asks whether it can work.

A diffusion policy's checkpoint must also be a pipeline this project has an adapter for
(``omni_async.models.SUPPORTED_PIPELINES``), read from its ``model_index.json`` where this machine has it (a local
directory, the hub cache, or the hub itself when reachable): a checkpoint of another class is refused here naming
it, not by diffusers inside a Ray actor.

:func:`omni_async.trainer.config.check_at_start` is what a run checks before Ray starts: the config and these model
paths, every problem found named at once.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from omegaconf import DictConfig

from omni_async.config_error import check
from omni_async.models import SUPPORTED_PIPELINES
from omni_async.models.tiny import (
    RANDOM_PREFIX,
    RANDOM_TOKENIZERS,
    SIM_PREFIX,
    SIM_SOURCES,
    TINY_BUILDERS,
    TINY_PREFIX,
    is_random,
    is_sim,
    is_tiny,
    unknown_random_family,
)

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
HUB_TIMEOUT_S = 10.0


def path_problem(path: str) -> str | None:
    """Why ``path`` does not resolve to a model, or None when it does."""
    path = str(path)
    if is_tiny(path):
        name = path[len(TINY_PREFIX) :]
        return None if name in TINY_BUILDERS else f"unknown tiny model (known: {', '.join(TINY_BUILDERS)})"
    if is_random(path):
        name = path[len(RANDOM_PREFIX) :]
        return None if name in RANDOM_TOKENIZERS else unknown_random_family(name)
    if is_sim(path):
        name = path[len(SIM_PREFIX) :]
        return None if name in SIM_SOURCES else f"unknown simulated device (known: {', '.join(SIM_SOURCES)})"
    local = Path(path).expanduser()
    if local.is_dir():
        return None
    if local.exists():
        return "a file, not a model directory"
    if not _HUB_ID.fullmatch(path):
        return "not a local directory (it does not exist), a tiny:<name>, or a Hugging Face hub id (org/name)"
    return _hub_problem(path)


def _hub_problem(repo_id: str) -> str | None:
    from huggingface_hub import constants, model_info, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        snapshot_download(repo_id, local_files_only=True)
        return None  # in this machine's hub cache
    except (LocalEntryNotFoundError, RepositoryNotFoundError, OSError, ValueError):
        pass
    if constants.HF_HUB_OFFLINE or os.environ.get("TRANSFORMERS_OFFLINE") == "1":
        return "a hub id that is not in this machine's Hugging Face cache, and the hub is off (HF_HUB_OFFLINE)"
    try:
        model_info(repo_id, timeout=HUB_TIMEOUT_S)
        return None
    except RepositoryNotFoundError:
        return "no such model on the Hugging Face hub (or it is private: log in with `hf auth login`)"
    except Exception as err:  # noqa: BLE001 - any failure to reach the hub means the load would fail too
        return f"a hub id not in this machine's cache, and the hub could not be reached ({type(err).__name__})"


def pipeline_class(path: str) -> str | None:
    """The diffusers pipeline class ``path``'s ``model_index.json`` names (``_class_name``), or None where this
    machine cannot read one without downloading the model: a ``tiny:`` model (built here, always a supported
    class), a hub id neither cached nor reachable, a checkpoint with no ``model_index.json`` (not a diffusers
    pipeline: loading it names what it is)."""
    path = str(path)
    if is_tiny(path) or is_random(path):
        return None
    index = Path(path).expanduser() / "model_index.json"
    if not index.is_file():
        if not _HUB_ID.fullmatch(path):
            return None
        index = _hub_file(path, "model_index.json")
        if index is None:
            return None
    try:
        name = json.loads(Path(index).read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None
    return str(name) if name else None


def _hub_file(repo_id: str, filename: str) -> Path | None:
    """``filename`` of hub model ``repo_id`` from this machine's cache, else from the hub when it is reachable."""
    from huggingface_hub import constants, hf_hub_download

    offline = constants.HF_HUB_OFFLINE or os.environ.get("TRANSFORMERS_OFFLINE") == "1"
    for local_only in (True,) if offline else (True, False):
        try:
            return Path(hf_hub_download(repo_id, filename, local_files_only=local_only, etag_timeout=HUB_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - not cached / not reachable / no such file: nothing to read here
            continue
    return None


def _pipeline_problem(path: str) -> str | None:
    cls = pipeline_class(path)
    if cls is None or cls in SUPPORTED_PIPELINES:
        return None
    return f"{path!r} is a {cls}; the diffusion pipelines trained here are {', '.join(SUPPORTED_PIPELINES)}"


_FIX = (
    "give a local model directory, a hub id this machine has cached or can download (e.g. Qwen/Qwen-Image), "
    "or a tiny: model on CPU (e.g. tiny:qwen_image)"
)


def check_model_paths(cfg: DictConfig) -> None:
    """The policy's ``actor_rollout_ref.model.path`` (for a diffusion policy: a supported pipeline too), the
    judge's ``reward.reward_model.model_path`` and the distillation teacher's checkpoint."""
    paths = {"actor_rollout_ref.model.path": cfg.actor_rollout_ref.model.path}
    if cfg.reward.reward_model.model_path is not None:
        paths["reward.reward_model.model_path"] = cfg.reward.reward_model.model_path
    if cfg.distillation.enabled:
        teacher = cfg.distillation.teacher_models.teacher_model.model_path
        paths["distillation.teacher_models.teacher_model.model_path"] = teacher
    for key, path in paths.items():
        problem = path_problem(path)
        check(problem is None, key, f"{path!r} does not resolve to a model: {problem}", _FIX)
    check(
        not is_random(paths.get("reward.reward_model.model_path", "")),
        "reward.reward_model.model_path",
        "random:<family> builds a diffusion policy's architecture, not a judge",
        "give the judge's model directory or hub id (or tiny:qwen2_vl on CPU)",
    )
    _check_override_config(cfg.actor_rollout_ref.model)
    if cfg.actor_rollout_ref.model.modality == "image":
        problem = _pipeline_problem(cfg.actor_rollout_ref.model.path)
        check(
            problem is None,
            "actor_rollout_ref.model.path",
            str(problem),
            "use a Qwen-Image, SD3 / SD3.5 or Wan 2.1 / 2.2 diffusers checkpoint (or a tiny: model on CPU)",
        )


def _check_override_config(model: DictConfig) -> None:
    """``actor_rollout_ref.model.override_config`` (verl's key): for a ``random:<family>`` policy every component and
    key must be one its architecture has (``models.random_models``); a saved diffusion pipeline takes none; a text
    model's keys are its Hugging Face config's (checked where the config is read, ``models.text_policy``)."""
    from omegaconf import OmegaConf

    override = OmegaConf.to_container(model.get("override_config") or OmegaConf.create({}), resolve=True)
    key = "actor_rollout_ref.model.override_config"
    if is_random(model.path):
        check(
            model.modality == "image",
            "actor_rollout_ref.model.path",
            "random:<family> sources are diffusion pipelines",
            "set actor_rollout_ref.model.modality=image, or give a text model (e.g. tiny:qwen2)",
        )
        if path_problem(model.path) is None:
            from omni_async.models.random_models import override_problems

            problems = override_problems(str(model.path)[len(RANDOM_PREFIX) :], override)
            check(
                not problems,
                key,
                "; ".join(problems),
                "use the component's own config keys, e.g. "
                "++actor_rollout_ref.model.override_config.transformer.num_layers=1",
            )
    elif is_sim(model.path) and path_problem(model.path) is None:
        simulated = str(model.path)[len(SIM_PREFIX) :]  # sim:<modality> (models.tiny.SIM_SOURCES)
        check(
            model.modality == simulated,
            "actor_rollout_ref.model.path",
            f"{model.path} simulates a {simulated} policy's device",
            f"set actor_rollout_ref.model.modality={simulated}",
        )
        from omni_async.models.sim_policy import SimTimings, sim_override_problems

        keys = SimTimings.keys()
        if simulated == "image":
            from omni_async.models.sim_image_policy import SimImageTimings

            keys = SimImageTimings.keys()
        problems = sim_override_problems(override, keys)
        check(not problems, key, "; ".join(problems), f"e.g. ++{key}.{keys[0]}=0.01")
    elif model.modality == "image":
        check(
            not override,
            key,
            f"changes a random:<family> architecture; {model.path!r} is loaded as saved",
            "drop override_config, or use random:<family> (e.g. random:qwen_image) for a dry run",
        )
