"""The stand-in for verl-omni's GenRM-OCR reward (``verl_omni/utils/reward_score/genrm_ocr.py``) in the recipe tests
(``verl_omni_recipe_data.STAND_INS``): this project's VLM judge (:mod:`omni_async.reward.scorers.vlm_judge`) reading
the image with the recipe's reward model (the tiny random Qwen2-VL judge), plus a tie-break.

Why the tie-break: a random tiny judge reads (almost) every random tiny image as the same text, so its OCR score is
the same for every sample of a group, GRPO's advantages are all 0 and a training step would move nothing. The
tie-break adds ``TIE_BREAK`` x the image's JPEG size in kB, which differs from sample to sample; the judge's own
score is kept as ``judge_score``."""

from __future__ import annotations

from typing import Any

from omni_async.reward.scorers import vlm_judge
from omni_async.reward.scorers.jpeg import jpeg_kb

TIE_BREAK = 1e-3


async def compute_score_ocr(
    data_source: str,
    solution_image: Any,
    ground_truth: Any,
    extra_info: dict | None = None,
    judge_model_path: str | None = None,
    judge_urls: list[str] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    out = await vlm_judge.compute_score(
        data_source,
        solution_image,
        ground_truth,
        extra_info,
        judge_model_path=judge_model_path,
        judge_urls=judge_urls,
        **kwargs,
    )
    return {**out, "score": out["score"] + TIE_BREAK * jpeg_kb(solution_image), "judge_score": out["score"]}
