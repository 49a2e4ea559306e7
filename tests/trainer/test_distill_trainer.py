"""DiffusionOPD (``loss_mode=distill_kl``, ``algos.distill``) through the trainer (real Ray, tiny SD3 student, a
tiny SD3 teacher with another transformer) with verl-omni's recipe keys (``examples/diffusionopd_trainer/sd35``):
the frozen teacher scores each training sample's own SDE window on the reward-loop workers, beside the reward, and
the update trains toward it. A trainer trains fully async on a rollout pool (the teacher on the reward-loop workers,
streamed); the recipe's own run (``tests/config/test_verl_omni_recipe_runs.py``) trains sync, lock-step, with the
teacher streamed on the reward pool; the colocated path (``reward.streaming=false``) is tested in process. What does
not fit is refused naming the fix."""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL_LORA, record_trained_uids

from omni_async.trainer.config import ConfigError, compose, validate

# verl-omni's run_sd35_medium_ocr_distill.sh, its distillation keys as written there (model, sizes and reward: the
# tiny stand-ins of helpers.SMALL_IMAGE_TRAINER; its teacher: tiny:sd3_teacher; window 3 in [0, 5] of 10: 2 in [0, 3])
OPD = [
    "distillation.enabled=True",
    "distillation.teacher_models.teacher_model.model_path=tiny:sd3_teacher",
    "actor_rollout_ref.actor.diffusion_loss.loss_mode=distill_kl",
    "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.actor.kl_loss_coef=0.0",
    "actor_rollout_ref.rollout.algo.noise_level=0.8",
    "actor_rollout_ref.rollout.algo.sde_type=cps",
    "actor_rollout_ref.rollout.algo.sde_window_size=2",
]
QUIET = ["trainer.log_image_freq=-1", "trainer.log_timeline_freq=-1", "trainer.total_training_steps=10"]
POOL = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1"]
SMALL_GROUPS = ["actor_rollout_ref.rollout.n=2"]  # 2 prompts x 2 samples a step


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        (["distillation.enabled=false"], "loss_mode", "distillation.enabled=true"),
        (
            ["actor_rollout_ref.actor.diffusion_loss.loss_mode=flow_grpo"],
            "distillation.enabled",
            "loss_mode=distill_kl",
        ),
        (["distillation.teacher_models.teacher_model.model_path=null"], "teacher_model.model_path", "checkpoint"),
        (["actor_rollout_ref.actor.diffusion_loss.loss_mode=distill_fm_mse"], "loss_mode", "loss_mode=distill_kl"),
    ],
)
def test_what_does_not_fit_distillation_is_refused_naming_the_fix(overrides, key, fix):
    base = ["data.train_files=x.jsonl", *SMALL_LORA, *OPD]
    assert validate(compose(base)).distillation.teacher_models.teacher_model.model_path == "tiny:sd3_teacher"
    with pytest.raises(ConfigError, match=rf"{key}.*Fix:.*{fix}"):
        validate(compose([*base, *overrides]))


def test_a_text_run_refuses_distillation():
    with pytest.raises(ConfigError, match=r"distillation.enabled.*causal LM.*Fix:"):
        validate(compose(["data.train_files=x.jsonl", "distillation.enabled=true"], config_name="grpo_text_trainer"))


@pytest.fixture(scope="module")
def teacher():
    """The teacher as the reward workers load it, in this process."""
    from omni_async.reward.teacher import Teacher

    sampling = {"height": 32, "width": 32, "num_inference_steps": 4, "noise_level": 0.8, "sde_type": "cps"}
    return Teacher({"model_path": "tiny:sd3_teacher", "student_path": "tiny:sd3", "sampling": sampling})


def assert_teacher_scored_the_samples_windows(samples, teacher) -> None:
    """Each trained sample came back with the teacher's velocity at each step of its own window: the velocities the
    teacher gives for the sample's stored states here, to float rounding."""
    from omni_async.reward.teacher import trajectory_fields

    for s in samples:
        v = s.outcome.teacher_velocity
        assert v is not None and v.shape == s.result.window_latents[1:].shape, s.index
        assert torch.allclose(v, teacher.velocities(trajectory_fields(s.result)), atol=1e-5)


def test_the_colocated_reward_scores_the_teacher_beside_it(teacher):
    """reward.streaming=false (in process, no Ray): after rollout, the colocated reward and then the teacher score the
    batch in the trainer process (StepOps.score_colocated); validation (teacher=False) leaves the teacher out."""
    from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig
    from omni_async.sample import PromptRow, RewardOutcome, Sample
    from omni_async.trainer.step_ops import StepOps
    from omni_async.trainer.timer import Timer

    sampling = SamplingConfig(height=32, width=32, num_inference_steps=4, noise_level=0.8, sde_type="cps")
    results = DiffusionPolicy("tiny:sd3", sampling).generate(["a cat", "a dog"], [1, 2], range(0, 2))

    class Colocated:  # the colocated reward manager's one call: a score per sample
        def score_batch(self, records):
            return [RewardOutcome("ok", score=1.0) for _ in records]

    reward = type("RewardSide", (), {"colocated": Colocated(), "colocated_teacher": teacher})()
    ops = StepOps(None, None, reward, None)

    def batch():
        row = PromptRow("a cat", "ocr", "cat")
        return [Sample(index=i, uid="u", row=row, seed=i, result=r) for i, r in enumerate(results)]

    samples, timer = batch(), Timer()
    ops.score_colocated(samples, timer)
    assert_teacher_scored_the_samples_windows(samples, teacher)
    assert timer.timing["timing_s/teacher"] > 0
    validation = batch()
    ops.score_colocated(validation, Timer(), teacher=False)
    assert all(s.outcome.ok and s.outcome.teacher_velocity is None for s in validation)


@pytest.mark.slow
def test_trains_fully_async(trainers, teacher):
    trainer = trainers(
        *OPD, *QUIET, *POOL, *SMALL_GROUPS, "async_reward.fully_async=true", "async_training.staleness_threshold=1"
    )
    trained = record_trained_uids(trainer.ops)
    steps = [trainer.train_step(step) for step in range(3)]  # 3 spans a lagged draw
    for metrics, samples in steps:
        assert_teacher_scored_the_samples_windows(samples, teacher)
        assert metrics["actor/distill_kl_loss"] > 0 and metrics["actor/grad_norm"] > 0
    assert any(s.version < step for step, (_, samples) in enumerate(steps) for s in samples)  # a stale draw trained
    uids = [s.uid for _, samples in steps for s in samples]
    assert sorted(set(trained)) == sorted(set(uids)) and len(trained) == len(uids)  # each sample trained once
