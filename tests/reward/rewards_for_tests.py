"""Reward functions the tests load by file path, the way users plug theirs (``custom_reward_function.path``).

Samples are identified by a CRC of their pixels, which depends only on the sample's seed.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import zlib

import numpy as np

from omni_async.reward.pixels import to_pixels
from omni_async.reward.scorers.jpeg import compute_score as jpeg_score

LOG = os.environ.get("OMNI_ASYNC_TEST_REWARD_LOG")


def sample_key(image) -> int:
    """CRC of the pixels in one layout (HWC), so a sample has one key as a numpy array or a verl-omni tensor."""
    return zlib.crc32(to_pixels(image).tobytes())


def _log(record: dict) -> None:
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps(record) + "\n")


class Flaky:
    """Per worker: call 1, 5, 9... raises; call 3, 7, ... hangs past any deadline; the rest score."""

    def __init__(self):
        self.calls = 0

    async def compute_score(self, data_source, solution_image, ground_truth, extra_info, **kw):
        self.calls += 1
        if self.calls % 4 == 1:
            raise RuntimeError("scorer backend returned 500")
        if self.calls % 4 == 3:
            await asyncio.sleep(3600)
        return jpeg_score(data_source, solution_image, ground_truth, extra_info)


async def slow_logged(data_source, solution_image, ground_truth, extra_info, delay_s=0.5, **kw):
    """Sleeps (no CPU) then scores; logs the sample only once its score is returned."""
    await asyncio.sleep(delay_s)
    score = jpeg_score(data_source, solution_image, ground_truth, extra_info)
    _log({"key": sample_key(solution_image), "pid": os.getpid()})
    return score


class GroupCentred:
    """An async slow scorer whose ``post_process_scores`` subtracts the group mean (and logs the group size)."""

    def __init__(self, delay_s: float = 1.0):
        self.delay_s = delay_s

    async def compute_score(self, data_source, solution_image, ground_truth, extra_info, **kw):
        await asyncio.sleep(self.delay_s)
        return {"score": float(sample_key(solution_image) % 1000) / 1000.0, "tag": "ok"}

    def post_process_scores(self, scores):
        _log({"group_size": len(scores)})
        mean = sum(scores) / len(scores)
        return [s - mean for s in scores]


def wrong_type(data_source, solution_image, ground_truth, extra_info, **kw):
    return "high"


def tuple_reward(data_source, solution_str, ground_truth, extra_info, **kw):
    """The async reward agent recipe's (score, text, explanation) return."""
    return float(len(solution_str) % 3), solution_str[:5], "length mod 3"


class FailingThenRepaired:
    """Text: fails for responses of even length; post-processing replaces failures by the group mean."""

    def compute_score(self, data_source, solution_str, ground_truth, extra_info, **kw):
        if len(solution_str) % 2 == 0:
            raise ValueError("judge timeout")
        return 1.0 + len(solution_str) / 100

    def post_process_scores(self, scores):
        ok = [s for s in scores if s is not None]
        mean = sum(ok) / len(ok) if ok else 0.0
        return [mean if s is None else s for s in scores]


async def slow_constant(data_source, solution_str=None, ground_truth=None, extra_info=None, delay_s=1.0, **kw):
    await asyncio.sleep(delay_s)
    return 1.0


# ---- Reward functions written against verl-omni's contract: solution_image is a uint8 torch tensor (C, H, W), or
# (N, C, H, W) for video frames. They use tensor methods (.permute, .unsqueeze, .ndim) as verl-omni's HTTP scorer
# client, GenRM-OCR and JPEG-compressibility rewards do, so a numpy (H, W, 3) array makes them fail or lie.


def _require_uint8_tensor(solution_image):
    import torch

    if not isinstance(solution_image, torch.Tensor) or solution_image.dtype != torch.uint8:
        raise TypeError(
            f"expected a uint8 torch tensor, got {type(solution_image).__name__} {getattr(solution_image, 'dtype', '')}"
        )


def omni_style_permute_score(data_source, solution_image, ground_truth, extra_info, **kwargs):
    """Like an HTTP scorer client: the first frame, ``permute(1, 2, 0)`` to HWC, PIL; score = mean red / 255."""
    from PIL import Image

    _require_uint8_tensor(solution_image)
    image = solution_image[0] if solution_image.ndim == 4 else solution_image
    pil = Image.fromarray(image.permute(1, 2, 0).cpu().numpy())
    return {"score": float(np.asarray(pil)[..., 0].mean()) / 255.0, "width": pil.width}


async def omni_style_frames_score(data_source, solution_image, ground_truth, extra_info, **kwargs):
    """Like GenRM-OCR (async): ``unsqueeze(0)`` an image, ``[::frame_interval]`` a video, each frame ``permute``d;
    score = mean over frames of the mean pixel / 255; ``frames`` = frames scored."""
    _require_uint8_tensor(solution_image)
    frame_interval = (extra_info or {}).get("frame_interval", 1)
    if solution_image.ndim == 3:
        solution_image = solution_image.unsqueeze(0)
    elif solution_image.ndim == 4:
        solution_image = solution_image[::frame_interval]
    scores = [float(frame.permute(1, 2, 0).float().mean()) / 255.0 for frame in solution_image]
    return {"score": sum(scores) / len(scores), "frames": len(scores)}


def omni_style_jpeg_score(data_source, solution_image, ground_truth=None, extra_info=None, **kwargs):
    """Like verl-omni's JPEG compressibility: NCHW -> NHWC, each image saved as JPEG (quality 95), score = -kB/500
    of the first. It does not check its input: a numpy (H, W, 3) array is iterated row by row and scores the first
    row (the same wrong score for most images), which is the bug the CHW contract removes."""
    import io

    import torch
    from PIL import Image

    images = solution_image
    if isinstance(images, torch.Tensor):
        if images.ndim == 3:
            images = images.unsqueeze(0)
        images = images.cpu().numpy().transpose(0, 2, 3, 1)
    sizes = []
    for image in images:
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="JPEG", quality=95)
        sizes.append(buf.tell() / 1000.0)
    return -sizes[0] / 500.0


async def omni_style_http_signature(solution_image, ground_truth, server_url="unused", **kwargs):
    """verl-omni's HTTP client signature: no data_source / extra_info parameters, ``**kwargs`` takes them."""
    return omni_style_permute_score(None, solution_image, ground_truth, None)


def blocking_sleep(
    data_source, solution_str=None, solution_image=None, ground_truth=None, extra_info=None, delay_s=0.5, **kw
):
    """A sync (blocking) reward, like a judge called with a blocking HTTP client: holds a thread for delay_s."""
    time.sleep(delay_s)
    return 1.0


async def genrm_ocr_style(
    data_source,
    solution_image,
    ground_truth,
    extra_info,
    reward_router_address: str,
    reward_model_tokenizer=None,
    model_name=None,
):
    """verl-omni's GenRM-OCR signature and wire use (``verl_omni/utils/reward_score/genrm_ocr.py``, written here
    from its contract): POST an OpenAI chat completion with the image as a data URL to
    ``http://{reward_router_address}/v1/chat/completions`` with ``model=model_name``; score = 1 − normalised edit
    distance of the transcription."""
    import base64
    import io

    import aiohttp
    import Levenshtein
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(to_pixels(solution_image)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = {
        "model": model_name,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "Read the text."},
                ],
            }
        ],
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://{reward_router_address}/v1/chat/completions", json=body) as resp:
            text = (await resp.json())["choices"][0]["message"]["content"]
    gt, got = ground_truth.replace(" ", "").lower(), text.replace(" ", "").lower()
    dist = min(Levenshtein.distance(got, gt), len(gt))
    return {"score": 1 - dist / len(gt), "genrm_response": text, "router": reward_router_address, "model": model_name}
