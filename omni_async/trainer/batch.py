"""Scored samples -> the actor's ``DataProto``, per modality.

``rm_scores`` is present only when every sample already has its reward outcome (streamed); the loop runs its
colocated reward when it is missing, as verl does. Images / video: ``rm_scores`` [N, 1]. Text: token-level
[N, response_length], the score at the last valid response token (verl's placement), zeros elsewhere.
"""

from __future__ import annotations

import numpy as np
import torch
from verl import DataProto

from omni_async.agent_loop.manager import Sample


def _score(s: Sample) -> float:
    return s.outcome.score if s.outcome.ok else 0.0


def _pad(rows: list[list[int]], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, sl], mask[i, sl] = torch.tensor(r, dtype=torch.long), 1
    return ids, mask


def _image_tensors(samples: list[Sample], scored: bool) -> dict[str, torch.Tensor]:
    tensors = {"window_latents": torch.stack([s.generated["window_latents"] for s in samples]),
               "old_log_probs": torch.stack([s.generated["log_probs"] for s in samples])}
    if scored:
        tensors["rm_scores"] = torch.tensor([[_score(s)] for s in samples])
    return tensors


def _text_tensors(samples: list[Sample], scored: bool, pad_id: int = 0) -> dict[str, torch.Tensor]:
    prompt_ids, prompt_mask = _pad([s.generated["prompt_ids"] for s in samples], pad_id, left=True)
    response_ids, response_mask = _pad([s.generated["response_ids"] for s in samples], pad_id, left=False)
    old = torch.zeros(response_ids.shape)
    for i, s in enumerate(samples):
        old[i, : len(s.generated["log_probs"])] = s.generated["log_probs"]
    tensors = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
               "response_mask": response_mask, "old_log_probs": old}
    if scored:
        rm = torch.zeros(response_ids.shape)
        last = (response_mask.sum(-1) - 1).clamp(min=0)
        rm[torch.arange(len(samples)), last] = torch.tensor([_score(s) for s in samples])
        tensors["rm_scores"] = rm
    return tensors


def samples_to_batch(samples: list[Sample], window: tuple[int, int]) -> DataProto:
    scored = all(s.outcome is not None for s in samples)
    text = "response_ids" in samples[0].generated
    tensors = _text_tensors(samples, scored) if text else _image_tensors(samples, scored)
    return DataProto.from_dict(
        tensors=tensors,
        non_tensors={"prompt": np.array([s.row.prompt for s in samples], dtype=object),
                     "uid": np.array([s.uid for s in samples], dtype=object)},
        meta_info={"window_start": window[0]},
    )
