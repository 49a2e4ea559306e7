"""Kill and resume in the overlap modes with the final-latent losses: the pipeline with DiffusionNFT (its old policy),
fully async with the switch on and AWM (its EMA anchor): ``kill_resume.kill_then_resume``."""

from __future__ import annotations

import pytest
from kill_resume import IMAGE, POOL, kill_then_resume
from test_awm_trainer import AWM
from test_diffusion_nft import NFT

SEPARATE_ASYNC = [  # as tests/trainer/test_hybrid_switch.py runs it
    *POOL,
    "trainer.use_v1=true",
    "trainer.v1.trainer_mode=separate_async",
    "trainer.v1.separate_async.parameter_sync_step=1",
    "trainer.v1.sampler.max_off_policy_strategy=wait",
]
CASES = {
    "pipeline-hybrid-nft-update": (
        "flowgrpo_trainer",
        [*IMAGE, *NFT, "async_reward.update_pipeline=true", "algorithm.global_std=false"],
        "update",
        1,
    ),
    # verl v1's separate_async on the disaggregated layout with the trainer devices lending a hand (the switch on)
    "fully_async-switch-disaggregated-awm-checkpoint": (
        "flowgrpo_trainer",
        [*IMAGE, *AWM, *SEPARATE_ASYNC, "trainer.v1.separate_async.hybrid_rollout.enable_switch=true"],
        "checkpoint",
        1,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_kill_then_resume_trains_every_group_exactly_once(tmp_path, case):
    kill_then_resume(tmp_path, case, *CASES[case])
