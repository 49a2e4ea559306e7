"""The stand-in for verl-omni's HPSv3 reward (``verl_omni/utils/reward_score/hpsv3_reward.py``,
``compute_score_hpsv3``) in the recipe tests (``verl_omni_recipe_data.STAND_INS``): no HPSv3 checkpoint (a Qwen2-VL-7B
preference model) is reachable here, so a frame's raw score is its contrast instead (10 x the pixels' standard
deviation / 255, in [0, 5], on HPSv3's 0-10-ish scale), which differs from sample to sample.

Everything else is verl-omni's contract: its signature (``model_name``, ``reward_scale=0.1``, ``device``), the frames
it reads (a video is a uint8 ``[C, F, H, W]`` tensor, every ``extra_info["frame_interval"]``-th frame from the first,
4 by default; an image ``[C, H, W]`` is one frame), the score (the mean over those frames of ``reward_scale`` x the raw
score) and its return (``{"score", "hpsv3_raw"}``, the raw mean). Unlike verl-omni's it reads channels-first tensors
only and refuses any other layout naming the shape, so the recipe's run shows the video arrived in the layout verl-omni's
file reads. The checkpoint (``custom_reward_model_path`` in the environment, or ``model_name``) is not read."""

from __future__ import annotations

from typing import Any

import torch


def sampled_frames(solution_image: torch.Tensor, frame_interval: int) -> torch.Tensor:
    """The frames HPSv3 scores, ``(N, C, H, W)``: a ``[C, F, H, W]`` video's frames ``0, k, 2k, ...`` (``k =
    frame_interval``), or a ``[C, H, W]`` image as one frame."""
    if not isinstance(solution_image, torch.Tensor) or solution_image.dtype != torch.uint8:
        raise TypeError(f"solution_image must be a uint8 torch.Tensor (verl-omni's form), got {type(solution_image)}")
    shape = tuple(solution_image.shape)
    if solution_image.ndim not in (3, 4) or shape[0] not in (1, 3):
        raise ValueError(f"solution_image of shape {shape} is neither [C, H, W] nor [C, F, H, W] with C in (1, 3)")
    if solution_image.ndim == 3:
        return solution_image.unsqueeze(0)
    return solution_image[:, ::frame_interval].permute(1, 0, 2, 3)


def compute_score_hpsv3(
    data_source: str,
    solution_image: Any,
    ground_truth: str,
    extra_info: dict,
    model_name: str | None = None,
    reward_scale: float = 0.1,
    device: str | None = None,
    **kwargs: Any,
) -> dict[str, float]:
    frames = sampled_frames(solution_image, int(extra_info.get("frame_interval", 4)))
    raw = [10.0 * float(frame.float().std(correction=0)) / 255.0 for frame in frames]
    return {"score": sum(r * reward_scale for r in raw) / len(raw), "hpsv3_raw": sum(raw) / len(raw)}
