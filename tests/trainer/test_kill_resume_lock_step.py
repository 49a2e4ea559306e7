"""Kill and resume in the lock-step modes (sync, stream, one-step-off) and text: ``kill_resume.kill_then_resume``."""

from __future__ import annotations

import pytest
from kill_resume import IMAGE, POOL, SPLIT, TEXT, kill_then_resume

CASES = {
    "sync-hybrid-checkpoint": ("flowgrpo_trainer", [*IMAGE, "reward.streaming=false"], "checkpoint", 1),
    "stream-split-reward": ("flowgrpo_trainer", [*IMAGE, *SPLIT, "reward.streaming=true"], "reward", 1),
    "one_step_off-disaggregated-update": (
        "flowgrpo_trainer",
        [*IMAGE, *POOL, "async_reward.one_step_off_policy=true"],
        "update",
        1,
    ),
    "text-sync-hybrid-update": ("grpo_text_trainer", [*TEXT, "reward.streaming=false"], "update", 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_kill_then_resume_trains_every_group_exactly_once(tmp_path, case):
    kill_then_resume(tmp_path, case, *CASES[case])
