"""Scorers the server can run, by name or ``module:function``.

A scorer takes a batch and returns one result per item::

    scorer(images: list[np.ndarray], prompts: list[str], ground_truths: list[str | None], metadata: dict)
        -> list[float | dict]       # a dict needs "score"; its other keys are that item's details

It runs in a worker thread (never on the event loop), one batch at a time per process.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

Scorer = Callable[[list[np.ndarray], list[str], list[Any], dict[str, Any]], list[Any]]


def ocr_scorer(images, prompts, ground_truths, metadata):
    """PP-OCR (rapidocr, offline) text vs ground truth, flow_grpo's edit-distance rule; video = mean of frames."""
    from omni_async.reward.scorers import ocr

    out = []
    for img, gt in zip(images, ground_truths, strict=True):
        if gt is None:
            frames = img if img.ndim == 4 else img[None]
            out.append({"score": 0.0, "ocr_text": " | ".join(ocr.read_text(f) for f in frames),
                        "note": "no ground truth"})
        else:
            out.append(ocr.compute_score("http", img, gt,
                                         substring_shortcut=bool(metadata.get("substring_shortcut", True))))
    return out


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


def normalize(results: list[Any], n: int, spec: str) -> list[tuple[float, dict[str, Any]]]:
    if not isinstance(results, (list, tuple)) or len(results) != n:
        raise TypeError(f"scorer {spec} returned {type(results).__name__} for {n} items; return a list of {n}")
    out = []
    for r in results:
        detail: dict[str, Any] = {}
        if isinstance(r, dict):
            detail = {k: v for k, v in r.items() if k != "score"}
            r = r.get("score")
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not np.isfinite(r):
            raise TypeError(f"scorer {spec} returned {r!r} as a score; return finite floats")
        out.append((float(r), detail))
    return out
