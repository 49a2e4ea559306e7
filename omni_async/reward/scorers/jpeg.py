"""JPEG (in)compressibility rewards, as in DDPO / flow_grpo: the size of the image saved as JPEG, in kB.

Plain reward functions in the verl convention; usable with no model at all, which makes them the reward of the
learning tests. ``compute_score`` (compressibility) is ``-kB``, ``compute_score_incompressibility`` is ``+kB``.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

from omni_async.reward.pixels import RewardContractError, frames_of, to_pixels


def as_pil(image: Any, name: str = "solution_image") -> Image.Image:
    """One image in any form :func:`omni_async.reward.pixels.to_pixels` accepts (verl-omni's uint8 tensor
    ``(C, H, W)``, a uint8 array ``(H, W, 3)`` / ``(H, W)``, a PIL image) as an RGB PIL image; a video is an error
    naming the argument (score its frames: :func:`omni_async.reward.pixels.frames_of`)."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    arr = to_pixels(image, name)
    if arr.ndim != 3:
        raise RewardContractError(f"{name} is a video {arr.shape}; expected one image")
    return Image.fromarray(arr)


def jpeg_kb(image: Any, quality: int = 95) -> float:
    """JPEG size in kB; for a video (``(C, F, H, W)`` tensor, ``(F, H, W, 3)`` array, list of frames) the mean
    over its frames."""
    sizes = []
    for frame in frames_of(image):
        buf = io.BytesIO()
        Image.fromarray(frame).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    return float(np.mean(sizes))


def _kb_reward(name: str, sign: float, doc: str) -> Callable[..., float]:
    """A reward function in verl's convention: ``sign`` x the JPEG size in kB (``quality``: the JPEG quality)."""

    def reward(
        data_source: str,
        solution_image: Any,
        ground_truth: Any = None,
        extra_info: dict | None = None,
        quality: int = 95,
        **kwargs: Any,
    ) -> float:
        return sign * jpeg_kb(solution_image, quality)

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = doc
    return reward


compute_score = _kb_reward(
    "compute_score", -1.0, "JPEG compressibility: higher for images that compress well (``-kB``)."
)
compute_score_incompressibility = _kb_reward(
    "compute_score_incompressibility", 1.0, "JPEG incompressibility: higher for detailed images (``+kB``)."
)
