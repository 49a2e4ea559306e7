"""JPEG (in)compressibility rewards, as in DDPO / flow_grpo: the size of the image saved as JPEG, in kB.

Plain reward functions in the verl convention; usable with no model at all, which makes them the reward of the
learning tests. ``compute_score`` (compressibility) is ``-kB``, ``compute_score_incompressibility`` is ``+kB``.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image


def as_pil(image: Any, name: str = "solution_image") -> Image.Image:
    """Accept a PIL image or a uint8 array [H, W, 3] / [H, W]; anything else is an error naming the argument."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    arr = np.asarray(image)
    if arr.dtype != np.uint8 or arr.ndim not in (2, 3):
        raise TypeError(f"{name} must be a PIL image or a uint8 array [H, W, 3]; got {arr.dtype} {arr.shape}")
    return Image.fromarray(arr).convert("RGB")


def jpeg_kb(image: Any, quality: int = 95) -> float:
    """JPEG size in kB; for a video (uint8 [T, H, W, 3]) the mean over its frames."""
    if not isinstance(image, Image.Image) and np.asarray(image).ndim == 4:
        return float(np.mean([jpeg_kb(frame, quality) for frame in np.asarray(image)]))
    buf = io.BytesIO()
    as_pil(image).save(buf, format="JPEG", quality=quality)
    return buf.tell() / 1000.0


def compute_score(data_source: str, solution_image: Any, ground_truth: Any = None, extra_info: dict | None = None,
                  quality: int = 95, **kwargs) -> float:
    """JPEG compressibility: higher for images that compress well (``-kB``)."""
    return -jpeg_kb(solution_image, quality)


def compute_score_incompressibility(data_source: str, solution_image: Any, ground_truth: Any = None,
                                    extra_info: dict | None = None, quality: int = 95, **kwargs) -> float:
    """JPEG incompressibility: higher for detailed images (``+kB``)."""
    return jpeg_kb(solution_image, quality)
