"""Kill and resume in the lock-step modes (sync, stream, one-step-off: with Diffusion-DPO, whose pairs are made inside
each group, so a group trained once is a pair trained once and whole) and text: ``kill_resume.kill_then_resume``."""

from __future__ import annotations

import pytest
from kill_resume import IMAGE, POOL, SPLIT, TEXT, kill_then_resume
from test_dpo_trainer import DPO

CASES = {
    "sync-hybrid-checkpoint": ("flowgrpo_trainer", [*IMAGE, "reward.streaming=false"], "checkpoint", 1),
    "stream-split-reward": ("flowgrpo_trainer", [*IMAGE, *SPLIT, "reward.streaming=true"], "reward", 1),
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
