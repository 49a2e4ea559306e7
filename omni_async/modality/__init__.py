"""Image/video vs text, decided in one place.

``actor_rollout_ref.model.modality`` picks a :class:`Modality`; everything that differs between a diffusion policy
and a causal LM goes through it: how to build the policy and its sampling config, whether generation takes an
SDE window, the batch tensors a step's samples become, the per-mini-batch loss, and how samples are saved for a
person to look at. The rest of the system (agent loop, reward loop, step loop, strategies) is modality-neutral.
"""

from __future__ import annotations

from omni_async.modality.base import REF_TIME_KEY, Modality
from omni_async.modality.image import ImageModality
from omni_async.modality.text import TextModality

__all__ = ["REF_TIME_KEY", "Modality", "get_modality"]

MODALITIES: dict[str, type] = {"image": ImageModality, "text": TextModality}


def get_modality(name: str) -> Modality:
    if name not in MODALITIES:
        raise ValueError(f"actor_rollout_ref.model.modality={name!r}: use image (diffusion) or text (causal LM)")
    return MODALITIES[name]()
