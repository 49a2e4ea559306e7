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


def decode_image(raw: bytes, fmt: str, field: str, limits: Limits) -> np.ndarray:
    """Encoded bytes -> uint8 [H, W, 3]; the pixel count is checked from the header, before any decoding."""
    try:
        img = Image.open(io.BytesIO(raw))
    except Exception:
        raise BadRequest(field, f"{field}: not a readable {fmt} image") from None
    if img.format is None or img.format.lower() not in ({"png"} if fmt == "png" else {"jpeg", "mpo"}):
        raise BadRequest(field, f"{field}: declared format {fmt!r} but the bytes are {img.format or 'unknown'}")
    w, h = img.size
    if w * h > limits.max_pixels or w <= 0 or h <= 0:
        raise BadRequest(field, f"{field}: {w}x{h} exceeds the server's limit of {limits.max_pixels} pixels per "
                                "image; send a smaller image", status=413)
    try:
        return np.asarray(img.convert("RGB"))
    except Exception:
        raise BadRequest(field, f"{field}: the {fmt} data is truncated or corrupt") from None


def decode_b64(item: ImageItem, field: str, limits: Limits) -> np.ndarray:
    try:
        raw = base64.b64decode(item.data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{field}.data", f"{field}.data: not valid base64") from None
    return decode_image(raw, item.format, f"{field}.data", limits)


def decode_request(req: ScoreRequest, limits: Limits) -> list[np.ndarray]:
    """Validate counts and decode every item (a video becomes [T, H, W, 3])."""
    n = len(req.images)
    frames = sum(len(x) if isinstance(x, list) else 1 for x in req.images)
    if n == 0:
        raise BadRequest("images", "images: empty; send at least one image")
    if frames > limits.max_images:
        raise BadRequest("images", f"images: {frames} images (frames included) exceed the limit of "
                                   f"{limits.max_images} per request; split the request", status=413)
    if len(req.prompts) != n:
        raise BadRequest("prompts", f"prompts: {len(req.prompts)} prompts for {n} images; send one per image")
    if req.ground_truths is not None and len(req.ground_truths) != n:
        raise BadRequest("ground_truths", f"ground_truths: {len(req.ground_truths)} for {n} images; one per image")
    out = []
    for i, item in enumerate(req.images):
        if isinstance(item, list):
            if not item:
                raise BadRequest(f"images[{i}]", f"images[{i}]: a video with no frames")
            video = [decode_b64(f, f"images[{i}][{k}]", limits) for k, f in enumerate(item)]
            if len({v.shape for v in video}) != 1:
                raise BadRequest(f"images[{i}]", f"images[{i}]: frames of different sizes")
            out.append(np.stack(video))
        else:
            out.append(decode_b64(item, f"images[{i}]", limits))
    return out
