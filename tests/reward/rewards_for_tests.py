"""Reward functions the tests load by file path, the way users plug theirs (``custom_reward_function.path``).

Samples are identified by a CRC of their pixels, which depends only on the sample's seed.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import zlib

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


# Rendezvous points, per reward-worker process: a call that waits at one returns only once ``parties`` calls are
# inside the reward function at the same time. A test of concurrency then asserts that the calls succeeded, which
# holds on a machine of any speed; a worker running fewer calls at once leaves them waiting until ``timeout_s`` and
# they fail.
_THREAD_BARRIERS: dict[int, threading.Barrier] = {}
_ASYNC_GATES: dict[int, _AsyncGate] = {}


class _AsyncGate:
    def __init__(self, parties: int):
        self.parties, self.arrived, self.opened = parties, 0, asyncio.Event()

    async def wait(self, timeout_s: float) -> None:
        self.arrived += 1
        if self.arrived >= self.parties:
            self.opened.set()
        try:
            await asyncio.wait_for(self.opened.wait(), timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{self.arrived} of {self.parties} calls had come when this one gave up") from None


async def running_together(parties: int, timeout_s: float) -> None:
    """Wait (on the event loop) until ``parties`` async calls have reached this point."""
    await _ASYNC_GATES.setdefault(parties, _AsyncGate(parties)).wait(timeout_s)


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
    """An async slow scorer whose ``post_process_scores`` subtracts the group mean (and logs the group size). With
    ``parties``, a call starts its ``delay_s`` only once ``parties`` calls are in (:func:`running_together`). Each
    result carries the call's own duration, ``own_s``."""

    def __init__(self, delay_s: float = 1.0, parties: int = 0, timeout_s: float = 100.0):
        self.delay_s, self.parties, self.timeout_s = delay_s, parties, timeout_s

    async def compute_score(self, data_source, solution_image, ground_truth, extra_info, **kw):
        t0 = time.perf_counter()
        if self.parties:
            await running_together(self.parties, self.timeout_s)
        await asyncio.sleep(self.delay_s)
        own_s = time.perf_counter() - t0
        return {"score": float(sample_key(solution_image) % 1000) / 1000.0, "tag": "ok", "own_s": own_s}

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


async def async_rendezvous(
    data_source, solution_str=None, ground_truth=None, extra_info=None, parties=2, timeout_s=25.0, **kw
):
    """An async reward (like a remote judge) that returns only once ``parties`` calls are in flight together."""
    await running_together(parties, timeout_s)
    return 1.0


# ---- Reward functions with verl-omni's signatures and input handling. verl-omni's own files are in
# verl_omni_rewards/ (jpeg_compressibility, genrm_ocr); these take what those files take -- a uint8 torch tensor
# (C, H, W), or (C, F, H, W) for a video -- and read it the way they do (tensor methods, no conversion), so a numpy
# (H, W, 3) array or a frames-first video makes them fail instead of scoring something else.


def _require_uint8_tensor(solution_image):
    import torch

    if not isinstance(solution_image, torch.Tensor) or solution_image.dtype != torch.uint8:
        raise TypeError(
            f"expected a uint8 torch tensor, got {type(solution_image).__name__} {getattr(solution_image, 'dtype', '')}"
        )


def genrm_frames(solution_image, extra_info):
    """The frames a video reward of verl-omni reads, as ``genrm_ocr.compute_score_ocr`` normalises its input: 3-D
    ``[C, H, W]`` is one frame; 4-D is ``[F, H, W, C]`` if its last axis is 1 or 3, else ``[C, F, H, W]``, every
    ``extra_info["frame_interval"]``-th frame (default 4) kept. Returns ``[N, C, H, W]``."""
    if solution_image.ndim == 3:
        return solution_image.unsqueeze(0)
    frame_interval = (extra_info or {}).get("frame_interval", 4)
    if solution_image.shape[-1] in (1, 3):
        solution_image = solution_image.permute(3, 0, 1, 2)
    return solution_image[:, ::frame_interval].permute(1, 0, 2, 3)


async def cfhw_video_score(data_source, solution_image, ground_truth, extra_info):
    """A video reward with verl-omni's single-reward signature that refuses anything but a uint8 ``[C, F, H, W]``
    tensor (C = 3, the last axis not 1 or 3, so ``genrm_ocr`` / ``hpsv3_reward`` would read it the same way);
    frames as :func:`genrm_frames`; score = mean over frames of the mean red value / 255."""
    _require_uint8_tensor(solution_image)
    if solution_image.ndim != 4 or solution_image.shape[0] != 3 or solution_image.shape[-1] in (1, 3):
        raise ValueError(f"expected a [C, F, H, W] video with C = 3, got {tuple(solution_image.shape)}")
    frames = genrm_frames(solution_image, extra_info)
    scores = [float(frame.permute(1, 2, 0)[..., 0].float().mean()) / 255.0 for frame in frames]
    _log({"shape": list(solution_image.shape)})
    return {"score": sum(scores) / len(scores), "frames": len(scores)}


async def http_client_signature(solution_image, ground_truth, server_url, max_retries=2, **kwargs):
    """verl-omni's ``http_scorer_client.compute_score`` signature (no data_source / extra_info parameters, a required
    ``server_url``, ``**kwargs`` takes the rest); it reads an image as ``permute(1, 2, 0)`` of a ``(C, H, W)``
    tensor, as that client does. Score: mean red / 255."""
    _require_uint8_tensor(solution_image)
    return {"score": float(solution_image.permute(1, 2, 0)[..., 0].float().mean()) / 255.0, "server": server_url}


def blocking_rendezvous(
    data_source,
    solution_str=None,
    solution_image=None,
    ground_truth=None,
    extra_info=None,
    parties=2,
    timeout_s=25.0,
    **kw,
):
    """A sync (blocking) reward, like a judge called with a blocking HTTP client: holds its thread until ``parties``
    calls hold one each (a barrier; too few threads and it breaks after ``timeout_s``). Returns its own duration."""
    t0 = time.perf_counter()
    try:
        _THREAD_BARRIERS.setdefault(parties, threading.Barrier(parties)).wait(timeout_s)
    except threading.BrokenBarrierError:
        raise TimeoutError(f"fewer than {parties} calls ever ran at once") from None
    return {"score": 1.0, "own_s": time.perf_counter() - t0}


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


_CALLS = {"n": 0}


async def blocks_after(data_source, solution_image=None, solution_str=None, ground_truth=None, extra_info=None, **kw):
    """JPEG compressibility (text: length mod 3), until call ``$OMNI_ASYNC_TEST_KILL_AFTER`` of this worker process:
    from then on it touches ``$OMNI_ASYNC_TEST_KILL_READY`` and never returns, so a test can kill the trainer with
    reward calls in flight (and, in the streaming modes, samples still generating)."""
    _CALLS["n"] += 1
    after = int(os.environ.get("OMNI_ASYNC_TEST_KILL_AFTER", "-1"))
    if 0 <= after < _CALLS["n"]:
        open(os.environ["OMNI_ASYNC_TEST_KILL_READY"], "a").close()
        await asyncio.sleep(3600)
    if solution_str is not None:
        return float(len(solution_str) % 3)
    return jpeg_score(data_source, solution_image, ground_truth, extra_info)


def latent_contract(solution_image, extra_info):
    """What a latent reward (verl-omni's DRM client) is handed, as text in its extra info: ``solution_image``'s dtype
    and shape, and each tensor of ``extra_info`` with its own."""

    def form(t):
        return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"

    tensors = {k: form(v) for k, v in extra_info.items() if hasattr(v, "dtype") and hasattr(v, "shape")}
    return {"score": 0.0, "solution": form(solution_image), "tensors": tensors}
