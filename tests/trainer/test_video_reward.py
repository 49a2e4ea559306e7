"""A video run reaches its reward as verl-omni's video rewards read it: one streamed training step of a tiny Wan
with a reward that refuses anything but a uint8 ``[C, F, H, W]`` tensor (``rewards_for_tests.cfhw_video_score``,
which normalises its input as verl-omni's ``genrm_ocr`` does) trains with no failed sample."""

from __future__ import annotations

import json

from helpers import TEST_REWARDS, Trainers, write_prompts

FRAMES, SIDE = 5, 32


def test_a_cfhw_only_video_reward_trains_a_step_with_no_failure(tmp_path, monkeypatch):
    log = tmp_path / "shapes.jsonl"
    monkeypatch.setenv("OMNI_ASYNC_TEST_REWARD_LOG", str(log))  # the reward workers inherit it
    trainers = Trainers(write_prompts(tmp_path / "p.jsonl", 4), tmp_path)
    try:
        trainer = trainers(
            "actor_rollout_ref.model.path=tiny:wan",
            f"actor_rollout_ref.rollout.pipeline.num_frames={FRAMES}",
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=2",
            f"reward.custom_reward_function.path={TEST_REWARDS}",
            "reward.custom_reward_function.name=cfhw_video_score",
            "reward.streaming=true",
        )
        metrics, samples = trainer.train_step(0)
    finally:
        trainers.close()
    assert metrics["reward/failed"] == 0 and metrics["reward/masked"] == 0
    assert metrics["critic/rewards/std"] > 0  # scored from the frames: the samples differ
    shapes = [json.loads(line)["shape"] for line in log.read_text().splitlines()]
    assert len(samples) == 4 and shapes == [[3, FRAMES, SIDE, SIDE]] * 4  # every sample: channels, then frames
