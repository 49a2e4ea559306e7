"""Reward functions the tests load by file path, the way users plug theirs (``custom_reward_function.path``).

Samples are identified by a CRC of their pixels, which depends only on the sample's seed.
"""

from __future__ import annotations

import asyncio
import json
import os
import zlib

import numpy as np

from omni_async.reward.scorers.jpeg import compute_score as jpeg_score

LOG = os.environ.get("OMNI_ASYNC_TEST_REWARD_LOG")


def sample_key(image) -> int:
    return zlib.crc32(np.ascontiguousarray(image).tobytes())


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
