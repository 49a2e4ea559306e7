"""Protocol v1 of the scorer server (JSON), and the checks every request passes before any image is decoded.

``POST /v1/score``::

    {"images": [{"data": "<base64>", "format": "png" | "jpeg"}            # one image per item, or
                [{"data": ..., "format": ...}, ...]],                   # a list of frames (a video)
     "prompts": ["...", ...],                                           # one per item
     "ground_truths": ["...", ...],                                     # optional, one per item
     "metadata": {...}}                                                 # optional, passed to the scorer

    -> {"protocol_version": "1", "scores": [float, ...], "details": [{...}, ...]}

Errors are 4xx with ``{"error": "<what and how to fix>", "field": "<where>"}``.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

PROTOCOL_VERSION = "1"


class ImageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    data: str = Field(description="base64 of the encoded image bytes")
    format: Literal["png", "jpeg"] = "png"


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    images: list[ImageItem | list[ImageItem]] = Field(description="one image per item, or a list of video frames")
    prompts: list[str]
    ground_truths: list[str] | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class ScoreResponse(BaseModel):
    protocol_version: str = PROTOCOL_VERSION
    scores: list[float]
    details: list[dict[str, Any]]


class BadRequest(ValueError):
    """A request that cannot be scored; ``field`` names where, the message says how to fix it."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(message)
        self.field, self.status = field, status


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 32 << 20
    max_images: int = 64  # items per request (a video counts its frames)
    max_pixels: int = 4096 * 4096  # per image, checked from the header before decoding


@dataclass
class Planned:
    """A request's images, headers read and checked, nothing decoded: ``items[i]`` is ``(raw, fmt, field)`` or a
    list of them (a video's frames), as a scorer process decodes them (:func:`decode_item`);
    ``kept_pixels`` / ``peak_pixels`` are what the in-flight budget reserves (see budget.py)."""

    items: list[Any]
    kept_pixels: int
    peak_pixels: int


def kept_size(w: int, h: int, max_side: int | None) -> tuple[int, int]:
    """The size an image is brought to before the scorer sees it: its long side at most ``max_side``."""
    if not max_side or max(w, h) <= max_side:
        return w, h
    s = max_side / max(w, h)
    return max(1, min(max_side, round(w * s))), max(1, min(max_side, round(h * s)))


def open_image(raw: bytes, fmt: str, field: str, limits: Limits) -> Image.Image:
    """Read the header only (PIL opens lazily): format and pixel count are checked before any decoding."""
    try:
        img = Image.open(io.BytesIO(raw))
    except Exception:
        raise BadRequest(field, f"{field}: not a readable {fmt} image") from None
    if img.format is None or img.format.lower() not in ({"png"} if fmt == "png" else {"jpeg", "mpo"}):
        img.close()
        raise BadRequest(field, f"{field}: declared format {fmt!r} but the bytes are {img.format or 'unknown'}")
    w, h = img.size
    if w * h > limits.max_pixels or w <= 0 or h <= 0:
        img.close()
        raise BadRequest(
            field,
            f"{field}: {w}x{h} exceeds the server's limit of {limits.max_pixels} pixels per "
            "image; send a smaller image",
            status=413,
        )
    return img


def decode_opened(img: Image.Image, field: str, max_side: int | None = None) -> np.ndarray:
    """A header-checked lazy image -> uint8 [H, W, 3], brought to ``kept_size`` (JPEG: the decoder itself scales
    down by 1/2..1/8 first). Only the returned array outlives the call."""
    w, h = img.size
    target = kept_size(w, h, max_side)
    src = img
    try:
        if target != (w, h) and img.format in ("JPEG", "MPO"):
            img.draft("RGB", target)
        img.load()
        if img.mode != "RGB":
            rgb = img.convert("RGB")
            img.close()
            img = rgb
        if img.size != target:
            small = img.resize(target, Image.Resampling.BOX, reducing_gap=2.0)
            img.close()
            img = small
        return np.asarray(img)  # a copy of the pixels: the PIL buffers are closed below
    except Exception:
        raise BadRequest(field, f"{field}: the image data is truncated or corrupt") from None
    finally:
        img.close()
        src.close()


def decode_image(raw: bytes, fmt: str, field: str, limits: Limits, max_side: int | None = None) -> np.ndarray:
    """Encoded bytes -> uint8 [H, W, 3]; the pixel count is checked from the header, before any decoding."""
    return decode_opened(open_image(raw, fmt, field, limits), field, max_side)


def decode_item(item: Any, limits: Limits, max_side: int | None = None) -> np.ndarray:
    """One planned item -> uint8 [H, W, 3], or [T, H, W, 3] for a video (its frames decoded one after another)."""
    if isinstance(item, list):
        return np.stack([decode_image(raw, fmt, field, limits, max_side) for raw, fmt, field in item])
    raw, fmt, field = item
    return decode_image(raw, fmt, field, limits, max_side)


def b64_bytes(item: ImageItem, field: str) -> bytes:
    try:
        return base64.b64decode(item.data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{field}.data", f"{field}.data: not valid base64") from None


def check_counts(n_items: int, n_frames: int, limits: Limits) -> None:
    if n_items == 0:
        raise BadRequest("images", "images: empty; send at least one image")
    if n_frames > limits.max_images:
        raise BadRequest(
            "images",
            f"images: {n_frames} images (frames included) exceed the limit of "
            f"{limits.max_images} per request; split the request",
            status=413,
        )


def plan_images(items: list[Any], limits: Limits, max_side: int | None = None) -> Planned:
    """``items[i]`` = ``(raw, fmt, field)`` or a list of them (a video). Headers only; nothing is decoded."""
    kept, largest = 0, 0
    for i, item in enumerate(items):
        frames = item if isinstance(item, list) else [item]
        if not frames:
            raise BadRequest(f"images[{i}]", f"images[{i}]: a video with no frames")
        sizes = set()
        for raw, fmt, field in frames:
            img = open_image(raw, fmt, field, limits)
            sizes.add(img.size)
            img.close()
        if len(sizes) != 1:
            raise BadRequest(f"images[{i}]", f"images[{i}]: frames of different sizes")
        w, h = sizes.pop()
        kw, kh = kept_size(w, h, max_side)
        kept += kw * kh * len(frames)
        largest = max(largest, w * h)
    return Planned(list(items), kept, kept + largest)


def plan_request(req: ScoreRequest, limits: Limits, max_side: int | None = None) -> Planned:
    """Validate counts, base64-decode and read every header (a video's frames must share one size)."""
    n = len(req.images)
    check_counts(n, sum(len(x) if isinstance(x, list) else 1 for x in req.images), limits)
    if len(req.prompts) != n:
        raise BadRequest("prompts", f"prompts: {len(req.prompts)} prompts for {n} images; send one per image")
    if req.ground_truths is not None and len(req.ground_truths) != n:
        raise BadRequest("ground_truths", f"ground_truths: {len(req.ground_truths)} for {n} images; one per image")
    items: list[Any] = []
    for i, item in enumerate(req.images):
        if isinstance(item, list):
            items.append(
                [(b64_bytes(f, f"images[{i}][{k}]"), f.format, f"images[{i}][{k}].data") for k, f in enumerate(item)]
            )
        else:
            items.append((b64_bytes(item, f"images[{i}]"), item.format, f"images[{i}].data"))
    return plan_images(items, limits, max_side)
