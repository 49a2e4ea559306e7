"""The stand-in for verl-omni's PickScore reward (``pkg://verl_omni.utils.reward_score.pickscore_reward``,
``compute_score_pickscore``) in the recipe tests (``verl_omni_recipe_data.STAND_INS``): no PickScore / CLIP-H model
is reachable here, so it scores how close the edited image stays to its input image (minus the mean absolute pixel
difference, in [-1, 0]), which differs from sample to sample. Its signature is verl-omni's; it reads the input image
where this project hands it over, ``extra_info["condition_images"]`` (a list of uint8 ``(3, H, W)`` tensors, the form
of ``solution_image``), and fails without one: the edit recipe's run shows the reward received it."""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from omni_async.reward.pixels import to_pixels


def compute_score_pickscore(
    data_source: str, solution_image: Any, ground_truth: str, extra_info: dict, **kwargs: Any
) -> dict[str, float]:
    inputs = extra_info.get("condition_images")
    if not inputs:
        raise KeyError("extra_info['condition_images'] is missing: the reward got no input image")
    out = to_pixels(solution_image)
    first = Image.fromarray(to_pixels(inputs[0])).resize((out.shape[1], out.shape[0]))
    distance = float(np.abs(out.astype(np.float32) - np.asarray(first, dtype=np.float32)).mean() / 255.0)
    return {"score": -distance, "input_distance": distance}
