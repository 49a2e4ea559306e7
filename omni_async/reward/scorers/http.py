"""HTTP scorer client: a reward function that asks a remote scorer server (``python -m http_scorer serve`` or a
flow_grpo / verl-omni scorer) for the score.

    reward.custom_reward_function.path=pkg://omni_async.reward.scorers.http
    reward.custom_reward_function.name=compute_score        # or HttpScorer (the class, built once per worker)
    +reward.custom_reward_function.reward_kwargs.server_url=http://scorer:19082

Samples that arrive together (within ``max_wait_ms``, up to ``max_batch``) go out as one HTTP call; one pooled
``httpx.AsyncClient`` per worker and event loop; retries with backoff and jitter on connect errors, timeouts,
408 / 429 / 5xx (a 503's ``Retry-After`` is honoured, at most ``max_retry_after_s``), never on another 4xx or on
an error inside a 200 body. Several ``server_url`` s are used least-loaded first. Keys this client does not know
are forwarded to the server as ``metadata``.

Each result carries ``http_retries`` (HTTP-level retries of the call that carried this sample; a micro-batch's
retries count for each of its samples) and ``http_timeouts`` (its attempts that timed out), for the trainer's
per-step ``reward/http_retries`` metric. Errors name the URL.

Protocols: ``v1`` (JSON, images base64 PNG by default, JPEG with ``image_format=jpeg``) and ``flow_grpo``
(pickled request; the pickled response is read with a restricted unpickler that admits only plain containers,
strings, bytes and numbers, so a malicious server cannot run code here).

Logging: a scorer's creation (its servers and protocol) is INFO; a batch that fails is WARNING, at most once per
scorer per ``http_client.LOG_INTERVAL_S`` (retries, timeouts and exhausted retries are ``http_client``'s); each sent
batch is DEBUG.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import pickle
import time
import weakref
from typing import Any

from PIL import Image

from omni_async.batching import MicroBatcher
from omni_async.logs import Throttle
from omni_async.reward.http_client import LOG_INTERVAL_S, Connection, RetryTally, RewardHTTPError
from omni_async.reward.pixels import to_pixels
from omni_async.reward.safe_pickle import UnsafePickleError, safe_loads
from omni_async.sample import is_video

logger = logging.getLogger(__name__)


def encode_image(image: Any, fmt: str = "png", quality: int = 95) -> bytes:
    buf = io.BytesIO()
    pil = image if isinstance(image, Image.Image) else Image.fromarray(to_pixels(image))
    pil.convert("RGB").save(buf, format="PNG" if fmt == "png" else "JPEG", quality=quality)
    return buf.getvalue()


class _Pending:
    def __init__(self, image, prompt: str, ground_truth, future: asyncio.Future):
        self.image, self.prompt, self.ground_truth, self.future = image, prompt, ground_truth, future


class _LoopQueue:
    """One event loop's samples waiting to be sent, and the task that sends them as they come due."""

    def __init__(self, max_batch: int, max_wait_ms: float):
        self.waiting: MicroBatcher[_Pending] = MicroBatcher(max_batch, max_wait_ms)
        self.drain: asyncio.Task | None = None
        self.sending: set[asyncio.Task] = set()  # held here: the loop keeps only weak references to tasks


class HttpScorer:
    def __init__(
        self,
        server_url: str | list[str],
        protocol: str = "v1",
        max_batch: int = 16,
        max_wait_ms: float = 10.0,
        image_format: str = "png",
        jpeg_quality: int = 95,
        **options: Any,
    ):
        """``options``: the :class:`~omni_async.reward.http_client.Connection` fields (``timeout_s``, ``max_retries``,
        ``backoff_s``, ``max_retry_after_s``, ``token``, ``seed``); any other key goes to the server as metadata."""
        if protocol not in ("v1", "flow_grpo"):
            raise ValueError(f"http scorer protocol={protocol!r}: use v1 or flow_grpo")
        if image_format not in ("png", "jpeg"):
            raise ValueError(f"http scorer image_format={image_format!r}: use png (lossless, OCR-safe) or jpeg")
        self.http, self.metadata = Connection.split(server_url, options)
        self.stats = self.http.stats
        self.protocol, self.max_batch, self.max_wait_ms = protocol, int(max_batch), float(max_wait_ms)
        self.image_format, self.jpeg_quality = image_format, int(jpeg_quality)
        self._throttle = Throttle(LOG_INTERVAL_S)
        logger.info(
            "HTTP scorer: %s, protocol %s, batches of up to %d within %gms, timeout %gs, %d retries",
            ", ".join(self.http.urls),
            protocol,
            int(max_batch),
            float(max_wait_ms),
            self.http.timeout_s,
            self.http.policy.max_retries,
        )
        self._queues: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> _LoopQueue

    async def compute_score(
        self, data_source: str, solution_image: Any, ground_truth: Any = None, extra_info: dict | None = None, **kwargs
    ) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        queue = self._queues.get(loop)
        if queue is None:
            queue = self._queues[loop] = _LoopQueue(self.max_batch, self.max_wait_ms)
        item = _Pending(solution_image, str((extra_info or {}).get("prompt", "")), ground_truth, loop.create_future())
        queue.waiting.put(item)
        if queue.drain is None:
            queue.drain = loop.create_task(self._drain(queue))
        score, detail, tally = await item.future
        return {"score": score, **detail, "http_retries": tally.retries, "http_timeouts": tally.timeouts}

    async def _drain(self, queue: _LoopQueue) -> None:
        """Sends each batch as it comes due (full, or its oldest sample waited max_wait_ms) until none waits."""
        try:
            while batch := await queue.waiting.next_batch():
                task = asyncio.get_running_loop().create_task(self._send(batch))
                queue.sending.add(task)
                task.add_done_callback(queue.sending.discard)
        finally:
            queue.drain = None  # a finished task still holds its loop, the weak key of this queue

    async def _send(self, batch: list[_Pending]) -> None:
        tally = RetryTally()
        t0 = time.perf_counter()
        try:
            send = self._send_v1 if self.protocol == "v1" else self._send_flow_grpo
            results = await send(batch, tally)
        except Exception as e:
            if (held := self._throttle.ready("failed")) is not None:
                logger.warning(
                    "HTTP scorer batch of %d failed after %d retries: %s: %s (%d more failed batches since the last "
                    "report)",
                    len(batch),
                    tally.retries,
                    type(e).__name__,
                    e,
                    held,
                )
            for it in batch:
                if not it.future.done():
                    it.future.set_exception(e)
            return
        logger.debug(
            "HTTP scorer batch of %d scored in %.3fs (%d retries)", len(batch), time.perf_counter() - t0, tally.retries
        )
        for it, (score, detail) in zip(batch, results, strict=True):
            if not it.future.done():
                it.future.set_result((score, detail, tally))

    def _image_json(self, image: Any) -> dict | list:
        arr = to_pixels(image)  # verl-omni's CHW tensor, our HWC array or PIL -> uint8 (T,) H, W, 3
        if is_video(arr):  # a video: its frames
            return [self._image_json(frame) for frame in arr]
        data = encode_image(arr, self.image_format, self.jpeg_quality)
        return {"data": base64.b64encode(data).decode(), "format": self.image_format}

    async def _send_v1(self, batch: list[_Pending], tally: RetryTally) -> list[tuple[float, dict]]:
        gts = [None if it.ground_truth is None else str(it.ground_truth) for it in batch]
        body = {
            "images": [self._image_json(it.image) for it in batch],
            "prompts": [it.prompt for it in batch],
            "metadata": self.metadata,
        }
        if any(g is not None for g in gts):
            body["ground_truths"] = [g or "" for g in gts]
        response = await self.http.post("http-scorer", "/v1/score", tally, json=body)
        try:
            out = response.json()
        except json.JSONDecodeError:
            raise RewardHTTPError(
                f"scorer at {response.url} answered 200 with a non-JSON body: {response.text[:120]!r}"
            ) from None
        return self._results(out, len(batch), str(response.url))

    async def _send_flow_grpo(self, batch: list[_Pending], tally: RetryTally) -> list[tuple[float, dict]]:
        if any(is_video(to_pixels(it.image)) for it in batch):
            raise RewardHTTPError("the flow_grpo protocol carries images only; use protocol=v1 for videos")
        metadata = dict(self.metadata)
        if any(it.ground_truth is not None for it in batch):  # this project's server reads them; others ignore them
            metadata["ground_truths"] = ["" if it.ground_truth is None else str(it.ground_truth) for it in batch]
        body = pickle.dumps(
            {
                "images": [encode_image(it.image, "jpeg", self.jpeg_quality) for it in batch],
                "prompts": [it.prompt for it in batch],
                "metadata": metadata,
            }
        )
        response = await self.http.post("http-scorer", "/", tally, content=body)
        try:
            out = safe_loads(response.content)
        except UnsafePickleError as e:
            raise RewardHTTPError(f"scorer response from {response.url} refused: {e}") from None
        return self._results(out, len(batch), str(response.url))

    @staticmethod
    def _results(out: Any, n: int, url: str) -> list[tuple[float, dict]]:
        if not isinstance(out, dict) or "error" in out or not isinstance(out.get("scores"), list):
            raise RewardHTTPError(f"scorer at {url} answered 200 with an error or no scores: {str(out)[:160]}")
        scores = out["scores"]
        if len(scores) != n:
            raise RewardHTTPError(f"scorer at {url} returned {len(scores)} scores for {n} images")
        details = out.get("details") if isinstance(out.get("details"), list) else [{}] * n
        return [(float(s), dict(d) if isinstance(d, dict) else {}) for s, d in zip(scores, details, strict=True)]


_instances: dict[str, HttpScorer] = {}


async def compute_score(
    data_source: str, solution_image: Any, ground_truth: Any = None, extra_info: dict | None = None, **config: Any
) -> dict[str, Any]:
    """The function form: one :class:`HttpScorer` per distinct config in this process (its batching and pool)."""
    key = json.dumps(config, sort_keys=True, default=str)
    if key not in _instances:
        _instances[key] = HttpScorer(**config)
    return await _instances[key].compute_score(data_source, solution_image, ground_truth, extra_info)
