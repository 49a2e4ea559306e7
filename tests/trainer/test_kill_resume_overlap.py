"""Kill and resume in the overlap modes with the final-latent losses: the pipeline with DiffusionNFT (its old policy),
fully async with AWM (its EMA anchor): ``kill_resume.kill_then_resume``."""

from __future__ import annotations

import pytest
from kill_resume import IMAGE, SPLIT, kill_then_resume
from test_awm_trainer import AWM
from test_diffusion_nft import NFT

CASES = {
    "pipeline-hybrid-nft-update": (
        "flowgrpo_trainer",
        [*IMAGE, *NFT, "async_reward.update_pipeline=true", "algorithm.global_std=false"],
        "update",
        1,
    ),
    "fully_async-split-awm-checkpoint": (
        "flowgrpo_trainer",
        [*IMAGE, *AWM, *SPLIT, "async_reward.fully_async=true", "async_training.staleness_threshold=1"],
        "checkpoint",
        1,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_kill_then_resume_trains_every_group_exactly_once(tmp_path, case):
    kill_then_resume(tmp_path, case, *CASES[case])
