"""Kill and resume in the lock-step modes and text: ``kill_resume.kill_then_resume``. The training methods whose unit
is not one sample: offline Diffusion-DPO (no rollout: its pairs are drawn from the dataset by the resumable sampler, so
a pair is trained once, none skipped, across the kill), DiffusionOPD (the teacher scores each sample beside the reward
on the reward workers; killed mid reward) and online Diffusion-DPO (its pairs are made inside each group, so a group
trained once is a pair trained once and whole). Flow-GRPO's own image case gave way to them (the same producer and
checkpoint code; OPD's rollout is its SDE window, Flow-GRPO's)."""

from __future__ import annotations

import pytest
from kill_resume import IMAGE, OFFLINE_DPO, POOL, SPLIT, TEXT, kill_then_resume
from test_distill_trainer import OPD
from test_dpo_trainer import DPO

CASES = {
    "offline-hybrid-dpo-checkpoint": ("flowgrpo_trainer", [*IMAGE, *OFFLINE_DPO], "checkpoint", 1),
    "stream-split-opd-reward": ("flowgrpo_trainer", [*IMAGE, *SPLIT, *OPD, "reward.streaming=true"], "reward", 1),
    "one_step_off-disaggregated-dpo-update": (
        "flowgrpo_trainer",
        [*IMAGE, *DPO, *POOL, "async_reward.one_step_off_policy=true"],
        "update",
        1,
    ),
    "text-sync-hybrid-update": ("grpo_text_trainer", [*TEXT, "reward.streaming=false"], "update", 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_kill_then_resume_trains_every_group_exactly_once(tmp_path, case):
    kill_then_resume(tmp_path, case, *CASES[case])
