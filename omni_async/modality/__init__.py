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

__all__ = ["REF_TIME_KEY", "Modality", "get_modality", "modality_of"]

MODALITIES: dict[str, type] = {"image": ImageModality, "text": TextModality}


def get_modality(name: str, loss_mode: str | None = None, **loss_options) -> Modality:
    """The modality ``name``; an image modality trains with ``loss_mode`` (``None``: FlowGRPO) and its
    ``loss_options`` (:class:`ImageModality`)."""
    if name not in MODALITIES:
        raise ValueError(f"actor_rollout_ref.model.modality={name!r}: use image (diffusion) or text (causal LM)")
    if name == "image" and loss_mode is not None:
        return ImageModality(loss_mode, **loss_options)
    return MODALITIES[name]()


def modality_of(cfg) -> Modality:
    """The config's modality (``actor_rollout_ref.model.modality``) with its loss mode
    (``actor_rollout_ref.actor.diffusion_loss.loss_mode`` for images)."""
    arr = cfg.actor_rollout_ref
    if arr.model.modality != "image":
        return get_modality(arr.model.modality)
    dl = arr.actor.diffusion_loss
    return get_modality("image", dl.loss_mode, awm_weighting=dl.awm_weighting, awm_ghuber_power=dl.awm_ghuber_power)
