"""Model paths checked at start, on the driver, before Ray starts: a typo in ``model.path`` costs a second, not a
cluster start and diffusers' ValueError from inside a Ray actor half a minute later.

A path resolves when it is a ``tiny:<name>`` this project builds, a local directory, or a Hugging Face hub id
(``org/name``) that is in this machine's hub cache or, with the hub reachable, exists there (users with hub access
give ``Qwen/Qwen-Image``). Loading (and downloading) stays where it is; this only asks whether it can work.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from omegaconf import DictConfig

from omni_async.config_error import check
from omni_async.models.tiny import TINY_BUILDERS, TINY_PREFIX, is_tiny

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
HUB_TIMEOUT_S = 10.0


def path_problem(path: str) -> str | None:
    """Why ``path`` does not resolve to a model, or None when it does."""
    path = str(path)
    if is_tiny(path):
        name = path[len(TINY_PREFIX) :]
        return None if name in TINY_BUILDERS else f"unknown tiny model (known: {', '.join(TINY_BUILDERS)})"
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


def check_model_paths(cfg: DictConfig) -> None:
    """The policy's ``actor_rollout_ref.model.path`` and the judge's ``reward.reward_model.model_path``."""
    paths = {"actor_rollout_ref.model.path": cfg.actor_rollout_ref.model.path}
    if cfg.reward.reward_model.model_path is not None:
        paths["reward.reward_model.model_path"] = cfg.reward.reward_model.model_path
    for key, path in paths.items():
        problem = path_problem(path)
        check(
            problem is None,
            key,
            f"{path!r} does not resolve to a model: {problem}",
            "give a local model directory, a hub id this machine has cached or can download (e.g. Qwen/Qwen-Image), "
            "or a tiny: model on CPU (e.g. tiny:qwen_image)",
        )
