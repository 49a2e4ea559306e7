"""Scorers the server can run, by name or ``module:function``.

A scorer takes a batch and returns one result per item::

    scorer(images: list[np.ndarray], prompts: list[str], ground_truths: list[str | None], metadata: dict)
        -> list[float | dict]       # a dict needs "score"; its other keys are that item's details

It runs in a scorer process of the server (pool.py), one batch at a time per process.

Optional attributes on the function tell the server what the scorer needs:

- ``max_side`` (int): images are downscaled (aspect kept, box filter; JPEG scaled in the decoder) so their long
  side is at most this before the scorer sees them -- memory and time go to the pixels the model uses. ``ocr``:
  1024 px (flow_grpo's OCR images are 512-1024 px; PP-OCR's detector works at 736 px or less).
- ``needs_target`` (bool): every item must carry the target text; a request without it is answered 422 naming
  the field, instead of being scored 0.
- ``max_batch`` (int): the most items one call should get (the server uses the smaller of this and
  ``--max-batch``). A scorer that reads its images one after another gains nothing from a batch: a batch only
  holds every item until its last is scored, and leaves nothing queued for a process that frees up, so it idles
  while the answers travel and the next requests arrive. ``ocr``: 1.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from omni_async.reward.scores import normalize_result

Scorer = Callable[[list[np.ndarray], list[str], list[Any], dict[str, Any]], list[Any]]


def ocr_scorer(images, prompts, ground_truths, metadata):
    """PP-OCR (rapidocr, offline) text vs ground truth, flow_grpo's edit-distance rule; video = mean of frames."""
    from omni_async.reward.scorers import ocr

    if any(not gt for gt in ground_truths):  # the server answers 422 before this; direct callers get told too
        raise ValueError("ocr scorer: every item needs its target text (ground truth)")
    # One onnxruntime thread: the server runs one scorer process per core (--workers); see ocr.py's docstring.
    return [
        ocr.compute_score(
            "http", img, gt, substring_shortcut=bool(metadata.get("substring_shortcut", True)), intra_op_num_threads=1
        )
        for img, gt in zip(images, ground_truths, strict=True)
    ]


ocr_scorer.max_side = 1024
ocr_scorer.needs_target = True
ocr_scorer.max_batch = 1  # rapidocr reads one image per call


def jpeg_scorer(images, prompts, ground_truths, metadata):
    """JPEG compressibility (-kB), no model: the cheapest real scorer, for load tests."""
    from omni_async.reward.scorers.jpeg import jpeg_kb

    return [-jpeg_kb(img) for img in images]


def sleep_scorer(images, prompts, ground_truths, metadata):
    """A model-like latency per batch (``metadata.sleep_s``, default 50 ms, at most 5 s), then the JPEG score."""
    time.sleep(min(float(metadata.get("sleep_s", 0.05)), 5.0))
    return jpeg_scorer(images, prompts, ground_truths, metadata)


BUILTIN: dict[str, Scorer] = {"ocr": ocr_scorer, "jpeg": jpeg_scorer, "sleep": sleep_scorer}


def load_scorer(spec: str) -> Scorer:
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise ValueError(f"--scorer {spec!r}: use one of {', '.join(BUILTIN)} or module:function")
    module, name = spec.split(":", 1)
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"--scorer {spec!r}: {module} has no callable {name}")
    return fn


def max_side(scorer: Scorer) -> int | None:
    side = getattr(scorer, "max_side", None)
    return int(side) if side else None


def needs_target(scorer: Scorer) -> bool:
    return bool(getattr(scorer, "needs_target", False))


def max_batch(scorer: Scorer) -> int | None:
    n = getattr(scorer, "max_batch", None)
    return max(1, int(n)) if n else None


def normalize(results: list[Any], n: int, spec: str) -> list[tuple[float, dict[str, Any]]]:
    """Each item's ``(score, details)``: a number, or a dict with ``"score"`` (``omni_async.reward.scores``, the
    reward manager's rule too)."""
    if not isinstance(results, (list, tuple)) or len(results) != n:
        raise TypeError(f"scorer {spec} returned {type(results).__name__} for {n} items; return a list of {n}")
    return [normalize_result(spec, r, what="scorer") for r in results]
