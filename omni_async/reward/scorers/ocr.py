"""OCR reward: read the text in the image with PP-OCR and compare it with the ground truth.

Score (flow_grpo's rule)::

    gt, pred = lower-cased with all whitespace removed
    score    = 1 - min(edit_distance(pred, gt), len(gt)) / len(gt)

with the *substring shortcut* (on by default, as in flow_grpo): if ``gt`` occurs inside ``pred`` the score is 1.
``solution_image`` is verl-omni's uint8 tensor ``(C, H, W)`` (or a numpy ``(H, W, 3)`` array, or a PIL image).
Video (``(C, F, H, W)`` tensor, ``(F, H, W, 3)`` array or a list of frames) scores the mean over frames sampled
every ``frame_interval``.

The default engine is ``rapidocr`` (PP-OCR ONNX models shipped in its wheel: works offline); ``backend=paddleocr``
uses PaddleOCR with local model dirs (``det_model_dir``, ``rec_model_dir``). One engine per process, loaded on
first use.

Device of the rapidocr engine (``use_cuda``, rapidocr's own name for it; PaddleOCR picks its own): a reward worker on the dedicated reward pool owns a GPU, and
the OCR reads on it (onnxruntime's CUDA execution provider) rather than leaving it idle. ``auto`` (default) = on
the process's GPU when it has one and onnxruntime offers CUDA, else on CPU (and a warning when a GPU idles);
``true`` = on the GPU or an error naming what is missing; ``false`` = CPU. To score OCR on CPU without reserving a
GPU, leave the reward pool off (``reward.reward_model.enable_resource_pool=False``: the workers are CPU actors).
Without torch installed (the scorer server's own install, ``packages/scorer``) an onnxruntime CUDA build is taken
as the sign of a GPU.

CPU threads of the rapidocr engine (``intra_op_num_threads``, onnxruntime's name): ``None`` keeps onnxruntime's
default (one per core, spinning while they wait for work). Where several processes read at once (the scorer
server's ``--workers``, one per core), 1 is faster and far cheaper: measured here, 205 ms of CPU per 512x512 image
with 1 thread against 470-585 ms with the default, on a shared 2-core machine.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass, fields
from typing import Any

import Levenshtein
import numpy as np

from omni_async.reward.pixels import frames_of
from omni_async.reward.scorers.jpeg import as_pil

_WS = re.compile(r"\s+")
CUDA_EP = "CUDAExecutionProvider"
logger = logging.getLogger(__name__)


def ocr_similarity(pred: str, gt: str, substring_shortcut: bool = True) -> float:
    gt_n, pred_n = _WS.sub("", str(gt).lower()), _WS.sub("", str(pred).lower())
    if not gt_n:
        return 1.0 if not pred_n else 0.0
    if substring_shortcut and gt_n in pred_n:
        return 1.0
    return 1.0 - min(Levenshtein.distance(pred_n, gt_n), len(gt_n)) / len(gt_n)


def _local_cuda_device() -> int | None:
    """The CUDA device this process owns, or ``None``. In a Ray worker, Ray's assignment decides: a worker given no
    GPU owns none, even though it may see the machine's (Ray 2.60 leaves ``CUDA_VISIBLE_DEVICES`` alone for a worker
    without GPUs: seen on an H200, where the CPU reward actors beside the actor saw its device); a worker given one
    sees it as device 0 (Ray points ``CUDA_VISIBLE_DEVICES`` at it), or as Ray's id with
    ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``. Outside Ray (the scorer server), the visible device 0."""
    try:
        import torch
    except ImportError:
        import onnxruntime

        hidden = os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1")
        return 0 if CUDA_EP in onnxruntime.get_available_providers() and not hidden else None
    if not torch.cuda.is_available():
        return None
    try:
        import ray
    except ImportError:  # the scorer server installed beside torch, without Ray
        return 0
    if ray.is_initialized():
        ids = ray.get_gpu_ids()
        if not ids:
            return None
        return int(ids[0]) if os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") else 0
    return 0


@functools.cache
def _warn_idle_gpu(device: int, why: str) -> None:
    """Once per process: each read asks for the device."""
    logger.warning(
        "OCR reward reads on CPU while this worker holds GPU %d idle: %s. To score on CPU without "
        "reserving a GPU, set reward.reward_model.enable_resource_pool=False",
        device,
        why,
    )


def ocr_device(use_cuda: bool | str = "auto") -> int | None:
    """The CUDA device the OCR engine runs on, or ``None`` for CPU (see the module docstring for ``use_cuda``)."""
    if use_cuda not in ("auto", True, False):
        raise ValueError(f"OCR use_cuda={use_cuda!r}: use auto (the worker's GPU when it has one), true or false")
    if use_cuda is False:
        return None
    import onnxruntime

    device = _local_cuda_device()
    if device is not None and CUDA_EP in onnxruntime.get_available_providers():
        return device
    why = (
        "this process has no CUDA device (reward workers get one on the dedicated reward pool, "
        "reward.reward_model.enable_resource_pool=True)"
        if device is None
        else f"onnxruntime {onnxruntime.__version__} has no {CUDA_EP} (install the GPU build matching your CUDA: "
        "pip uninstall -y onnxruntime && pip install onnxruntime-gpu)"
    )
    if use_cuda is True:
        raise RuntimeError(f"OCR reward with use_cuda=true: {why}; or set use_cuda=auto / false (CPU)")
    if device is not None:
        _warn_idle_gpu(device, why)
    return None


def engine_params(
    device: int | None, det_limit_side_len: int, intra_op_num_threads: int | None = None
) -> dict[str, Any]:
    """rapidocr's ``params``: quiet, no angle classifier, the detector's side limit, onnxruntime's CUDA provider on
    ``device``, its CPU threads.

    The angle classifier is off as in flow_grpo's and verl-omni's OCR reward (``PaddleOCR(use_angle_cls=False)``) and
    this module's paddleocr backend (``cls=False``): generated text is upright, and rapidocr's default classifier
    turns some upright words over (``OHIO`` read as ``OIHO``), which would score a correct image as wrong."""
    params: dict[str, Any] = {
        "Global.log_level": "critical",
        "Global.use_cls": False,
        "Det.limit_side_len": det_limit_side_len,
    }
    if intra_op_num_threads:
        params["EngineConfig.onnxruntime.intra_op_num_threads"] = int(intra_op_num_threads)
    if device is not None:
        params.update(
            {"EngineConfig.onnxruntime.use_cuda": True, "EngineConfig.onnxruntime.cuda_ep_cfg.device_id": device}
        )
    return params


@dataclass(frozen=True)
class OcrEngine:
    """Which OCR engine reads the text, and how (see the module docstring): the reward kwargs of that name."""

    backend: str = "rapidocr"
    det_model_dir: str | None = None
    rec_model_dir: str | None = None
    det_limit_side_len: int = 256
    use_cuda: bool | str = "auto"
    intra_op_num_threads: int | None = None

    @classmethod
    def of(cls, kwargs: dict[str, Any]) -> OcrEngine:
        """The engine the keys of ``kwargs`` that name its fields describe (a reward function's other kwargs are
        not the engine's)."""
        return cls(**{f.name: kwargs[f.name] for f in fields(cls) if f.name in kwargs})


@functools.lru_cache(maxsize=4)
def _engine(spec: OcrEngine):
    """One engine per distinct spec in this process, loaded on first use."""
    if spec.backend == "rapidocr":
        from rapidocr import RapidOCR

        device = ocr_device(spec.use_cuda)
        return RapidOCR(params=engine_params(device, spec.det_limit_side_len, spec.intra_op_num_threads))
    if spec.backend == "paddleocr":
        try:
            from paddleocr import PaddleOCR
        except ImportError as e:
            raise ImportError("backend=paddleocr needs the optional extra: pip install 'omni-async[paddle]'") from e
        if not (spec.det_model_dir and spec.rec_model_dir):
            raise ValueError(
                "backend=paddleocr needs det_model_dir and rec_model_dir (local model dirs): "
                "PaddleOCR's default constructor downloads models, which fails offline"
            )
        return PaddleOCR(
            det_model_dir=spec.det_model_dir, rec_model_dir=spec.rec_model_dir, use_angle_cls=False, lang="en"
        )
    raise ValueError(f"unknown OCR backend {spec.backend!r}; use rapidocr (default) or paddleocr")


def read_text(image: Any, engine: OcrEngine | None = None) -> str:
    """The text in one image, as one string (``engine``: the default rapidocr one when not given)."""
    spec = engine or OcrEngine()
    arr = np.asarray(as_pil(image))
    if spec.backend == "rapidocr":
        return " ".join(_engine(spec)(arr).txts or ())
    result = _engine(spec).ocr(arr, cls=False) or []
    return " ".join(line[1][0] for page in result if page for line in page)


def sample_frames(solution_image: Any, frame_interval: int = 1) -> list[np.ndarray]:
    """An image as one uint8 ``(H, W, 3)`` frame; a video (verl-omni's ``(C, F, H, W)`` tensor, a ``(F, H, W, 3)``
    array or a list of frames) as every ``frame_interval``-th frame (:func:`omni_async.reward.pixels.frames_of`)."""
    return frames_of(solution_image, frame_interval)


def compute_score(
    data_source: str,
    solution_image: Any,
    ground_truth: Any,
    extra_info: dict | None = None,
    substring_shortcut: bool = True,
    frame_interval: int = 1,
    **kwargs: Any,
) -> dict:
    """OCR score of one image (or the mean over a video's sampled frames), with the recognised text. The engine:
    :class:`OcrEngine`'s fields among ``kwargs`` (``backend``, ``det_model_dir``, ``use_cuda``, ...)."""
    engine = OcrEngine.of(kwargs)
    texts, scores = [], []
    for frame in sample_frames(solution_image, frame_interval):
        text = read_text(frame, engine)
        texts.append(text)
        scores.append(ocr_similarity(text, ground_truth, substring_shortcut))
    return {"score": float(np.mean(scores)), "ocr_text": " | ".join(texts)}
