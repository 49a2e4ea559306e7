"""Stand-in scorers for ``bench/http_scorer.py --reference`` (served by both our server and the reference)."""

from __future__ import annotations

import time


def gpu_like_judge(images, prompts, ground_truths, metadata):
    """A GPU-like judge: a fixed cost per call (50 ms, a model forward on an accelerator) plus a small cost per
    image (2 ms), spent waiting (the GIL is free, as while a GPU computes); scores the mean pixel value."""
    time.sleep(JUDGE_FIXED_S + JUDGE_PER_IMAGE_S * len(images))
    return [float(img.mean()) / 255.0 for img in images]


JUDGE_FIXED_S, JUDGE_PER_IMAGE_S = 0.05, 0.002


def serial_scorer(images, prompts, ground_truths, metadata):
    """A scorer that cannot batch: 100 ms per image, one image after another, spent waiting. It has the structure
    of a CPU-bound scorer (one busy core per process) without needing idle cores, so on a shared machine it shows
    what the serving structure costs (connection spread, batch tails, gaps) apart from CPU contention."""
    time.sleep(SERIAL_PER_IMAGE_S * len(images))
    return [float(img.mean()) / 255.0 for img in images]


SERIAL_PER_IMAGE_S = 0.1
serial_scorer.max_batch = 1  # as the ocr scorer: nothing to gain from a batch
