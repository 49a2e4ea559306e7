"""OCR reward: read the text in the image with PP-OCR and compare it with the ground truth.

Score (flow_grpo's rule)::

    gt, pred = lower-cased with all whitespace removed
    score    = 1 - min(edit_distance(pred, gt), len(gt)) / len(gt)

with the *substring shortcut* (on by default, as in flow_grpo): if ``gt`` occurs inside ``pred`` the score is 1.
``solution_image`` is verl-omni's uint8 tensor ``(C, H, W)`` (or a numpy ``(H, W, 3)`` array, or a PIL image).
Video (``(N, C, H, W)`` tensor, ``(T, H, W, 3)`` array or a list of frames) scores the mean over frames sampled
every ``frame_interval``.

The default engine is ``rapidocr`` (PP-OCR ONNX models shipped in its wheel: works offline); ``backend=paddleocr``
uses PaddleOCR with local model dirs (``det_model_dir``, ``rec_model_dir``). One engine per process, loaded on
first use.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import Levenshtein
import numpy as np

from omni_async.reward.contract import frames_of
from omni_async.reward.scorers.jpeg import as_pil

_WS = re.compile(r"\s+")


def ocr_similarity(pred: str, gt: str, substring_shortcut: bool = True) -> float:
    gt_n, pred_n = _WS.sub("", str(gt).lower()), _WS.sub("", str(pred).lower())
    if not gt_n:
        return 1.0 if not pred_n else 0.0
    if substring_shortcut and gt_n in pred_n:
        return 1.0
    return 1.0 - min(Levenshtein.distance(pred_n, gt_n), len(gt_n)) / len(gt_n)


@functools.lru_cache(maxsize=4)
def _engine(backend: str, det_model_dir: str | None, rec_model_dir: str | None, det_limit_side_len: int):
    if backend == "rapidocr":
        from rapidocr import RapidOCR

        return RapidOCR(params={"Global.log_level": "critical", "Det.limit_side_len": det_limit_side_len})
    if backend == "paddleocr":
        try:
            from paddleocr import PaddleOCR
        except ImportError as e:
            raise ImportError("backend=paddleocr needs the optional extra: pip install 'omni-async[paddle]'") from e
        if not (det_model_dir and rec_model_dir):
            raise ValueError("backend=paddleocr needs det_model_dir and rec_model_dir (local model dirs): "
                             "PaddleOCR's default constructor downloads models, which fails offline")
        return PaddleOCR(det_model_dir=det_model_dir, rec_model_dir=rec_model_dir, use_angle_cls=False, lang="en")
    raise ValueError(f"unknown OCR backend {backend!r}; use rapidocr (default) or paddleocr")


def read_text(image: Any, backend: str = "rapidocr", det_model_dir: str | None = None,
              rec_model_dir: str | None = None, det_limit_side_len: int = 256) -> str:
    engine = _engine(backend, det_model_dir, rec_model_dir, det_limit_side_len)
    arr = np.asarray(as_pil(image))
    if backend == "rapidocr":
        return " ".join(engine(arr).txts or ())
    result = engine.ocr(arr, cls=False) or []
    return " ".join(line[1][0] for page in result if page for line in page)


def sample_frames(solution_image: Any, frame_interval: int = 1) -> list[np.ndarray]:
    """An image as one uint8 ``(H, W, 3)`` frame; a video (verl-omni's ``(N, C, H, W)`` tensor, a ``(T, H, W, 3)``
    array or a list of frames) as every ``frame_interval``-th frame (:func:`omni_async.reward.contract.frames_of`)."""
    return frames_of(solution_image, frame_interval)


def compute_score(data_source: str, solution_image: Any, ground_truth: Any, extra_info: dict | None = None,
                  backend: str = "rapidocr", substring_shortcut: bool = True, frame_interval: int = 1,
                  det_model_dir: str | None = None, rec_model_dir: str | None = None,
                  det_limit_side_len: int = 256, **kwargs) -> dict:
    """OCR score of one image (or the mean over a video's sampled frames), with the recognised text."""
    texts, scores = [], []
    for frame in sample_frames(solution_image, frame_interval):
        text = read_text(frame, backend, det_model_dir, rec_model_dir, det_limit_side_len)
        texts.append(text)
        scores.append(ocr_similarity(text, ground_truth, substring_shortcut))
    return {"score": float(np.mean(scores)), "ocr_text": " | ".join(texts)}
