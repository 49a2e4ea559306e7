"""The pixel side of the reward contract: the one conversion each way between the trainer's pixels and a reward
function's ``solution_image`` (see :mod:`omni_async.reward.contract` for the whole contract).

The scorers (``reward.scorers.ocr`` / ``jpeg`` / ``http`` ...) import this module, and the contract's
``default_compute_score`` imports the scorers, so the dependency runs one way. Torch is imported only by
:func:`to_solution_image` (and :func:`to_pixels` reads a tensor only if its caller imported torch): the scorer
server's own install (``packages/scorer``) ships this module without torch.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np


class RewardContractError(TypeError):
    """A ``solution_image`` that is none of the accepted forms."""


def to_solution_image(pixels: Any) -> Any:
    """Our pixels -> ``solution_image`` as verl-omni passes it to reward functions.

    ``pixels``: uint8 numpy ``(H, W, 3)`` (an image) or ``(F, H, W, 3)`` (video frames), as the diffusion policy
    returns them (a PIL image, a list of frames, grey or RGBA pixels are accepted too and made RGB). Returns a
    contiguous uint8 CPU ``torch.Tensor`` in [0, 255]: ``(3, H, W)`` for an image, ``(3, F, H, W)`` for a video --
    channels first, then frames, the layout verl-omni's video rewards read (``genrm_ocr``, ``hpsv3_reward``: a 4-D
    tensor whose last axis is not 1 or 3 is ``[C, F, H, W]``). A tensor already in that form is returned as a
    contiguous CPU tensor. Anything else (float pixels, channels-first numpy, other ranks) is an error that says what
    was given.
    """
    import torch

    if isinstance(pixels, torch.Tensor):
        _check_channels_first(pixels, "pixels")
        if pixels.shape[0] == 3:
            return pixels.detach().to("cpu").contiguous()
    arr = to_pixels(pixels, "pixels")  # RGB, channels-last: (H, W, 3) or (F, H, W, 3)
    chw = np.moveaxis(arr, -1, 0)  # (3, H, W) or (3, F, H, W)
    return torch.from_numpy(np.ascontiguousarray(chw))


def to_pixels(solution_image: Any, name: str = "solution_image") -> np.ndarray:
    """Any accepted ``solution_image`` -> uint8 RGB numpy ``(H, W, 3)``, or ``(F, H, W, 3)`` for a video.

    Accepted: a uint8 torch tensor ``(C, H, W)`` / ``(C, F, H, W)`` (verl-omni), a uint8 numpy array
    ``(H, W, C)`` / ``(F, H, W, C)`` / ``(H, W)``, a PIL image, or a list / tuple of frames in any of these forms.
    ``C`` may be 1 (grey, repeated), 3, or 4 (alpha dropped). A tensor is always read channels-first and a numpy
    array channels-last (by type and rank, never guessed from the sizes). Torch is never imported here: a tensor can
    only exist if its caller already imported torch.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(solution_image, torch.Tensor):
        _check_channels_first(solution_image, name)
        arr = np.moveaxis(solution_image.detach().to("cpu").numpy(), 0, -1)  # (C, [F,] H, W) -> ([F,] H, W, C)
    elif isinstance(solution_image, (list, tuple)):
        if not solution_image:
            raise RewardContractError(f"{name} is an empty list of frames")
        frames = [to_pixels(f, f"{name}[{i}]") for i, f in enumerate(solution_image)]
        if any(f.ndim != 3 for f in frames) or len({f.shape for f in frames}) != 1:
            raise RewardContractError(
                f"{name}: frames must be single images of one size; got {sorted({f.shape for f in frames})}"
            )
        return np.stack(frames)
    elif _is_pil(solution_image):
        return np.asarray(solution_image.convert("RGB"))
    else:
        arr = _hwc_array(solution_image, name)
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    elif arr.shape[-1] == 4:
        arr = arr[..., :3]
    return np.ascontiguousarray(arr)


def frames_of(solution_image: Any, frame_interval: int = 1, name: str = "solution_image") -> list[np.ndarray]:
    """An image as one ``(H, W, 3)`` frame; a video as every ``frame_interval``-th of its frames."""
    arr = to_pixels(solution_image, name)
    return [arr] if arr.ndim == 3 else list(arr[:: max(1, int(frame_interval))])


def _is_pil(x: Any) -> bool:
    pil = sys.modules.get("PIL.Image")
    return pil is not None and isinstance(x, pil.Image)


def _check_channels_first(t: Any, name: str) -> None:
    import torch

    if t.dtype != torch.uint8:
        raise RewardContractError(
            f"{name} must be a uint8 tensor in [0, 255] (verl-omni's solution_image); got {t.dtype} {tuple(t.shape)}"
        )
    if t.ndim not in (3, 4) or t.shape[0] not in (1, 3, 4):
        hint = ""
        if t.ndim in (3, 4) and t.shape[-1] in (3, 4):
            hint = "; it looks channels-last: tensors are (C, H, W) / (C, F, H, W)"
        elif t.ndim == 4 and t.shape[1] in (1, 3, 4):
            hint = "; it looks frames-first (F, C, H, W): a video tensor is (C, F, H, W), use .permute(1, 0, 2, 3)"
        raise RewardContractError(
            f"{name} tensor must be (C, H, W) for an image or (C, F, H, W) for a video, C = 3; got "
            f"{tuple(t.shape)}{hint}"
        )


def _hwc_array(x: Any, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype != np.uint8:
        raise RewardContractError(f"{name} must be uint8 pixels in [0, 255]; got {arr.dtype} {arr.shape}")
    if arr.ndim == 2:
        return arr[..., None]
    if arr.ndim not in (3, 4) or arr.shape[-1] not in (1, 3, 4):
        hint = (
            "; it looks channels-first: pass a torch tensor for (C, H, W)"
            if arr.ndim in (3, 4) and arr.shape[-3] in (1, 3)
            else ""
        )
        raise RewardContractError(f"{name} numpy array must be (H, W, 3) or (F, H, W, 3); got {arr.shape}{hint}")
    return arr
