"""Offline Diffusion-DPO's data (``algorithm.sample_source=offline``): verl-omni's ``OfflineDPODataset`` parquet
columns, read with this project's parquet reader (``trainer.dataset``), each row one preference pair made into a
group of two scored samples (chosen, rejected) that the step loop trains as it trains an online group.

A row (verl-omni's ``examples/dpo_trainer/data_process/prepare_offline_dpo.py`` writes them):

- ``prompt`` (a string or verl's chat messages), optional ``extra_info.raw_prompt`` (preferred, as verl-omni);
- ``img_win`` / ``img_lose``: the images' paths (relative to the parquet's folder; shown in sample grids when present);
- ``img_win_latents`` / ``img_lose_latents``: their clean latents x0 (``torch.save`` bytes or nested lists);
- ``prompt_embeds``, ``prompt_embeds_mask``, ``pooled_prompt_embeds`` and optionally ``negative_prompt_embeds``,
  ``negative_prompt_embeds_mask``, ``negative_pooled_prompt_embeds``: the text encoders' outputs (same encodings);
- ``win_score`` / ``lose_score`` (default 1 / 0; a row with ``win_score < lose_score`` is an error, as verl-omni),
  optional ``uid``, ``data_source`` (default ``offline_dpo``), ``reward_model``.

The encodings must be the training model's (its text encoders' width; the latents its VAE's at the rollout's
``height`` x ``width``), as verl-omni's: ``examples/data/offline_dpo/make_offline_dpo.py`` makes them for a model.
"""

from __future__ import annotations

import io
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni_async.agent_loop.draws import sample_seed
from omni_async.agent_loop.rollouter import Group
from omni_async.sample import ImageResult, PromptRow, RewardOutcome, Sample
from omni_async.trainer.dataset import DatasetError, _prompt_text, _read_parquet

REQUIRED = (
    "prompt",
    "img_win",
    "img_lose",
    "img_win_latents",
    "img_lose_latents",
    "prompt_embeds",
    "prompt_embeds_mask",
    "pooled_prompt_embeds",
)
# the conditioning columns -> their mask column (a sequence is trimmed to its mask's tokens: unpadded, as a rollout's)
COND_COLUMNS = {
    "prompt_embeds": "prompt_embeds_mask",
    "pooled_prompt_embeds": None,
    "negative_prompt_embeds": "negative_prompt_embeds_mask",
    "negative_pooled_prompt_embeds": None,
}
THUMBNAIL_PX = 32  # a pair's picture in a sample grid when its image file is not there


@dataclass(frozen=True)
class PreferencePair:
    row: PromptRow
    uid: str
    latents: tuple[torch.Tensor, torch.Tensor]  # chosen, rejected x0
    scores: tuple[float, float]
    conditioning: dict[str, torch.Tensor]
    images: tuple[Path, Path]


def _tensor(value: Any, where: str, column: str) -> torch.Tensor:
    if value is None:
        raise DatasetError(f"{where}: column {column!r} is empty")
    if isinstance(value, bytes | bytearray | memoryview):
        t = torch.load(io.BytesIO(bytes(value)), map_location="cpu", weights_only=True)
        if not isinstance(t, torch.Tensor):
            raise DatasetError(f"{where}: column {column!r} holds {type(t).__name__}, not a torch.save'd tensor")
        return t.float()
    return torch.tensor(np.asarray(value).tolist(), dtype=torch.float32)


def _pair(raw: dict, where: str, folder: Path, index: int) -> PreferencePair:
    missing = [c for c in REQUIRED if c not in raw]
    if missing:
        raise DatasetError(f"{where}: missing verl-omni OfflineDPODataset column(s) {missing}")
    extra = raw.get("extra_info") or {}
    prompt = str(extra.get("raw_prompt") or "").strip() or _prompt_text(raw["prompt"], where)
    win, lose = float(raw.get("win_score", 1.0)), float(raw.get("lose_score", 0.0))
    if win < lose:
        raise DatasetError(f"{where}: win_score {win} < lose_score {lose} (the chosen image must score higher)")
    cond = {}
    for column, mask_column in COND_COLUMNS.items():
        if raw.get(column) is None:
            continue
        t = _tensor(raw[column], where, column)
        if mask_column is not None and raw.get(mask_column) is not None:
            t = t[_tensor(raw[mask_column], where, mask_column).bool()]
        cond[column] = t
    rm = raw.get("reward_model") or {"style": "model", "ground_truth": prompt}
    row = PromptRow(prompt, str(raw.get("data_source") or "offline_dpo"), rm.get("ground_truth", prompt), dict(extra))
    return PreferencePair(
        row=row,
        uid=str(raw.get("uid") or f"pair-{index}"),
        latents=tuple(_tensor(raw[f"img_{k}_latents"], where, f"img_{k}_latents") for k in ("win", "lose")),
        scores=(win, lose),
        conditioning=cond,
        images=(folder / str(raw["img_win"]), folder / str(raw["img_lose"])),
    )


def load_pairs(files: str | Sequence[str]) -> list[PreferencePair]:
    """Every row of the given ``.parquet`` files as a :class:`PreferencePair`; a bad row raises
    :class:`DatasetError` naming the file, the row and the column."""
    paths = [files] if isinstance(files, str) else list(files)
    pairs: list[PreferencePair] = []
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise DatasetError(f"{path}: file not found (data.train_files)")
        if path.suffix != ".parquet":
            raise DatasetError(f"{path}: offline DPO reads verl-omni's OfflineDPODataset parquet; use a .parquet file")
        pairs += [_pair(raw, f"{path}:row {n}", path.parent, len(pairs) + n - 1) for n, raw in _read_parquet(path)]
    if not pairs:
        raise DatasetError(f"{', '.join(map(str, paths))}: no rows")
    return pairs


def _thumbnail(path: Path) -> np.ndarray:
    """The image at ``path`` (uint8 RGB) for a sample grid; grey where the file is not there."""
    if path.exists():
        from PIL import Image

        with Image.open(path) as img:
            return np.asarray(img.convert("RGB"))
    return np.full((THUMBNAIL_PX, THUMBNAIL_PX, 3), 128, dtype=np.uint8)


def pair_groups(pairs: list[PreferencePair], draw: int, seed: int) -> list[Group]:
    """The draw's pairs as groups of two scored samples (chosen first), already "generated" and "scored" now: the
    uid is the pair's and the draw's (a pair drawn again in a later epoch is a new group), the seeds the trainer's
    (``trainer.seed``, the draw, the position), so each pair's forward-process draw is the same on a resume."""
    now = time.time()
    groups = []
    for p, pair in enumerate(pairs):
        samples = []
        for k in (0, 1):
            s = Sample(index=2 * p + k, uid=f"{pair.uid}@{draw}", row=pair.row, seed=sample_seed(seed, draw, 2 * p + k))
            s.result = ImageResult(
                pixels=_thumbnail(pair.images[k]),
                window_latents=torch.empty(0),
                log_probs=torch.empty(0),
                conditioning=pair.conditioning,
                latents_clean=pair.latents[k],
            )
            s.outcome = RewardOutcome("ok", pair.scores[k])
            s.version = 0
            s.times.requested = s.times.gen_start = s.times.gen_end = s.times.scored = now
            samples.append(s)
        groups.append(Group(seq=p, draw=draw, samples=samples, done=True, generated=2, t_done=now))
    return groups
