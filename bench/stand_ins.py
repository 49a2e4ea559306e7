"""Stand-in rollout workers and reward for ``bench/driver_cost.py``: no model, a real answer.

:class:`StandInRollout` is a Ray async actor with the rollout worker's ``generate`` signature. It waits a
generation time drawn from a lognormal distribution (seeded by the sample's seed, so a run is repeatable) and
answers a :class:`~omni_async.agent_loop.batcher.Generation` holding a small but complete
:class:`~omni_async.sample.ImageResult`: uint8 pixels, SDE-window latents, window log-probs and prompt encodings.

The actor never imports torch (64 of them share 2 cores): its result's tensors travel as a pickle made once on the
driver (:func:`result_template`) and rebuilt there by :func:`rebuild_generation`. Unpickling that template is the
work the driver does for a real worker's answer (an ``ImageResult`` in its wire form: ``ImageResult.__getstate__``),
so the driver's cost is the real one; only the pixels are made per sample (numpy, sent out of band by Ray as a real
worker's are).

:func:`stand_in_score` is the reward function the real reward-loop workers load (``reward.custom_reward_function``):
an ``async def`` (awaited on the worker's loop, no thread) that waits ``latency_s`` and scores the first pixel.
"""

from __future__ import annotations

import asyncio
import math
import os
import pickle
import random
import time
import warnings
from typing import Any

import numpy as np

TEMPLATE_FORMS = ("product", "torch", "zero_copy")


def result_template(
    window_size: int, latent_shape: tuple[int, ...], embed_shape: tuple[int, int], form: str = "product"
) -> bytes:
    """On the driver: the tensors of one image result (window latents [W+1, ...], log-probs [W], prompt encodings),
    pickled once as Ray pickles a real worker's answer: ``product``, an ``ImageResult`` as the product sends it (its
    tensors as numpy arrays); for comparison, ``torch``, the tensors with torch's own reducers (a ``torch.save`` per
    tensor, the product's form before), or ``zero_copy`` as Ray does under ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1``
    (each tensor's bytes as a numpy array, rebuilt with ``torch.from_numpy``)."""
    import io

    import torch

    from omni_async.sample import ImageResult

    if form not in TEMPLATE_FORMS:
        raise ValueError(f"unknown template form {form!r}: use one of {TEMPLATE_FORMS}")

    parts = {
        "window_latents": torch.randn(window_size + 1, *latent_shape),
        "log_probs": torch.randn(window_size),
        "conditioning": {
            "prompt_embeds": torch.randn(*embed_shape),
            "pooled_prompt_embeds": torch.randn(embed_shape[1]),
        },
    }
    if form == "product":  # the pixels are the stand-in's, per sample (rebuild_generation)
        return pickle.dumps(ImageResult(pixels=np.zeros((1, 1, 3), np.uint8), **parts), protocol=5)
    if form == "torch":
        return pickle.dumps(parts, protocol=5)
    from ray._private.tensor_serialization_utils import zero_copy_tensors_reducer

    class ZeroCopyPickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            return zero_copy_tensors_reducer(obj) if isinstance(obj, torch.Tensor) else NotImplemented

    buf = io.BytesIO()
    with warnings.catch_warnings():  # Ray warns that a tensor must not change after it is sent: these never do
        warnings.simplefilter("ignore")
        ZeroCopyPickler(buf, protocol=5).dump(parts)
    return buf.getvalue()


def rebuild_generation(
    template: bytes, pixels: np.ndarray, version: int, gen_start: float, gen_end: float, window_start: int
) -> Any:
    """On the driver, while Ray deserializes a stand-in's answer: the ``Generation`` a real worker would have sent."""
    from omni_async.agent_loop.batcher import Generation
    from omni_async.sample import ImageResult

    parts = pickle.loads(template)
    if isinstance(parts, ImageResult):
        parts.pixels, parts.window_start = pixels, window_start
        return Generation(parts, version, gen_start, gen_end)
    result = ImageResult(
        pixels=pixels,
        window_latents=parts["window_latents"],
        log_probs=parts["log_probs"],
        conditioning=parts["conditioning"],
        window_start=window_start,
    )
    return Generation(result, version, gen_start, gen_end)


class _Answer:
    """What a stand-in returns: pickles as a call of :func:`rebuild_generation` (by reference: this module is
    importable on both sides), so the worker needs neither torch nor ``omni_async``."""

    __slots__ = ("args",)

    def __init__(self, *args: Any):
        self.args = args

    def __reduce__(self):
        return rebuild_generation, self.args


def lognormal_mu(mean_s: float, sigma: float) -> float:
    """The ``mu`` of a lognormal with mean ``mean_s``: mean = exp(mu + sigma^2 / 2)."""
    return math.log(mean_s) - sigma * sigma / 2


class StandInRollout:
    """A rollout worker without a model (run as a Ray async actor: many requests wait at once, no thread each)."""

    def __init__(
        self, template: bytes, gen_mean_s: float, gen_sigma: float, image_size: int, worker_index: int = 0
    ) -> None:
        self.template, self.sigma, self.size = template, float(gen_sigma), int(image_size)
        self.mu = lognormal_mu(float(gen_mean_s), self.sigma)
        self.worker_index = worker_index
        self.version = 0
        self.requests = 0
        self.answered = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self._waiting: set[asyncio.Task] = set()  # the calls generating now (configure drops them)

    async def _generating(self, seconds: float) -> None:
        task = asyncio.current_task()
        self._waiting.add(task)
        try:
            await asyncio.sleep(seconds)
        finally:
            self._waiting.discard(task)

    def gen_time(self, seed: int) -> float:
        """The sample's generation time, a pure function of its seed."""
        return random.Random(seed).lognormvariate(self.mu, self.sigma)

    async def generate(
        self,
        prompt: str,
        seed: int,
        window: tuple[int, int] | None,
        *,
        sampling: dict[str, Any] | None = None,
        version: int | None = None,
        resume: Any = None,
    ) -> _Answer:
        """``RolloutReplica.generate``'s signature; answers after the sample's generation time."""
        self.requests += 1
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        t0 = time.time()
        try:
            await self._generating(self.gen_time(seed))
        finally:
            self.in_flight -= 1
        self.answered += 1
        return self._answer(seed, window, t0, time.time())

    async def generate_many(self, requests: list[tuple[str, int, tuple[int, int] | None, dict]]) -> list[_Answer]:
        """Several ``(prompt, seed, window, options)`` requests in one call (the agent loop's coalesced requests,
        ``RolloutWorker.generate_many``), answered together as one device batch is: after the generation time of the
        first one's seed."""
        self.requests += len(requests)
        self.in_flight += len(requests)
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        t0 = time.time()
        try:
            await self._generating(self.gen_time(requests[0][1]))
        finally:
            self.in_flight -= len(requests)
        self.answered += len(requests)
        t1 = time.time()
        return [self._answer(seed, window, t0, t1) for _prompt, seed, window, _kwargs in requests]

    def _answer(self, seed: int, window: tuple[int, int] | None, t0: float, t1: float) -> _Answer:
        pixels = np.full((self.size, self.size, 3), seed % 256, dtype=np.uint8)
        return _Answer(self.template, pixels, self.version, t0, t1, 0 if window is None else int(window[0]))

    def stats(self) -> dict[str, Any]:
        """The manager probes a restarted worker with this; the benchmark reads the request counts."""
        return {
            "worker_index": self.worker_index,
            "pid": os.getpid(),
            "requests": self.requests,
            "answered": self.answered,
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
        }

    async def drop(self) -> None:
        """Cancel the calls generating now: a stopped producer's, which nobody awaits any more, so that their answers
        do not reach the driver over the following minutes (the benchmark's variants share the workers)."""
        for task in list(self._waiting):
            task.cancel()

    async def configure(self, template: bytes) -> None:
        """The next variant: the last one's calls dropped, another answer format, counters from zero."""
        await self.drop()
        self.template = template
        self.requests = self.answered = self.peak_in_flight = 0


async def stand_in_score(
    data_source: str, solution_image: Any, ground_truth: Any, extra_info: dict, latency_s: float = 0.0
) -> float:
    """A trivially cheap reward with a latency: waits ``latency_s`` (a remote judge's answer time, no CPU) and scores
    the first pixel in [0, 1]."""
    if latency_s > 0:
        await asyncio.sleep(latency_s)
    return float(solution_image.reshape(-1)[0]) / 255.0
