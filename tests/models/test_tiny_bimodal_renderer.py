"""tiny:qwen_image_text_bimodal: the shipped renderer loads offline through DiffusionPolicy and its OCR reward is
hit-or-miss for the same prompt: some samples read fully, many read nothing, which seed decides (issue 25)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import shipped_renderer_policy

from omni_async.models import tiny
from omni_async.reward.scorers.ocr import compute_score

SEEDS = 2


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    yield from shipped_renderer_policy(tmp_path_factory, "tiny:qwen_image_text_bimodal")


def test_resolves_to_the_shipped_pipeline(policy):
    assert type(policy.pipe).__name__ == "QwenImagePipeline"
    assert tiny.resolve_model_path("tiny:qwen_image_text_bimodal") == policy.pipe.config._name_or_path  # cache hit


def test_ocr_reward_is_bimodal_on_held_out_words(policy, no_network):
    meta = json.loads((Path(policy.pipe.config._name_or_path) / "prompts.json").read_text())
    words = meta["val"]
    prompts = [meta["template"].format(text=w) for w in words]
    scores = np.stack(
        [
            [
                compute_score("ocr", img, w)["score"]
                for img, w in zip(
                    policy.rollout(prompts, [s * 1000 + i for i in range(len(words))], window=None).images,
                    words,
                    strict=True,
                )
            ]
            for s in range(SEEDS)
        ],
        1,
    )  # [words, seeds]
    # Measured, these 19 words x 2 seeds: mean 0.382, 24 % of samples read >= 0.9, 47 % read <= 0.1, 63 % of words
    # read differently across the seeds (2026-11-26, OCR without the angle classifier; with it 0.342 / 21 % / 53 %;
    # the pre-training script's MEASURED: 4 seeds, 0.329 / 18 % / 53 %). The
    # previous renderer, tiny:qwen_image_text, on its first 19 held-out words: 13 % >= 0.9, 16 % <= 0.1 (fails).
    flat = scores.ravel()
    assert (flat >= 0.9).mean() >= 0.05 and (flat <= 0.1).mean() >= 0.3, scores
    assert 0.1 <= flat.mean() <= 0.6, scores
    # The same word, another seed: a different read for some words (the noise picks the mode).
    assert (scores.std(1) > 0).mean() >= 0.2, scores
