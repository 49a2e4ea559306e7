"""JPEG (in)compressibility rewards, as in DDPO / flow_grpo: the size of the image saved as JPEG, in kB.

Plain reward functions in the verl convention; usable with no model at all, which makes them the reward of the
learning tests. ``compute_score`` (compressibility) is ``-kB``, ``compute_score_incompressibility`` is ``+kB``.
"""

from __future__ import annotations

import io
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
    """JPEG size in kB; for a video (``(N, C, H, W)`` tensor, ``(T, H, W, 3)`` array, list of frames) the mean
    over its frames."""
    sizes = []
    for frame in frames_of(image):
        buf = io.BytesIO()
        Image.fromarray(frame).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    return float(np.mean(sizes))


def compute_score(
    data_source: str,
    solution_image: Any,
    ground_truth: Any = None,
    extra_info: dict | None = None,
    quality: int = 95,
    **kwargs,
) -> float:
    """JPEG compressibility: higher for images that compress well (``-kB``)."""
    return -jpeg_kb(solution_image, quality)


def compute_score_incompressibility(
    data_source: str,
    solution_image: Any,
    ground_truth: Any = None,
    extra_info: dict | None = None,
    quality: int = 95,
    **kwargs,
) -> float:
    """JPEG incompressibility: higher for detailed images (``+kB``)."""
    return jpeg_kb(solution_image, quality)
