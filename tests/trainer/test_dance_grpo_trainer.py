"""DanceGRPO (``algos.dance_grpo``) through the trainer (real Ray, tiny SD3) with verl-omni's recipe keys
(``examples/dancegrpo_trainer/wan22``): the rollout draws its SDE window with DanceGRPO's step and the loss trains
it; one trainer goes stream -> pipeline -> one-step-off -> both -> sync, and fully async on a rollout pool. What does
not fit DanceGRPO is refused naming the fix."""

from __future__ import annotations

import math

import pytest
from helpers import SMALL_LORA, record_trained_uids, switch_mode, through_lock_step_modes

from omni_async.trainer.config import ConfigError, compose, validate

# verl-omni's run_wan22_5b_t2v_hpsv3_auto.sh, its DanceGRPO keys as written there (model, sizes and reward: the tiny
# stand-ins of helpers.SMALL_IMAGE_TRAINER; its sde_window_range [0, 5] of 10 steps: [0, 3] of the stand-in's 4)
DANCE = [
    "algorithm.adv_estimator=dance_grpo",
    "actor_rollout_ref.model.algorithm=dance_grpo",
    "actor_rollout_ref.actor.diffusion_loss.loss_mode=dance_grpo",
    "actor_rollout_ref.rollout.algo.noise_level=1.2",
    "actor_rollout_ref.rollout.algo.sde_type=dance_sde",
    "actor_rollout_ref.rollout.algo.sde_window_size=2",
]
QUIET = ["trainer.log_image_freq=-1", "trainer.log_timeline_freq=-1", "trainer.total_training_steps=10"]
POOL = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1"]
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        # DanceGRPO's own code trains a random timestep_fraction of all steps; verl-omni's trains the SDE window
        (["algorithm.timestep_fraction=0.6"], "algorithm.timestep_fraction", "sde_window_size"),
        # the loss follows model.algorithm (verl-omni's pairing)
        (["actor_rollout_ref.model.algorithm=flow_grpo"], "loss_mode", "model.algorithm=dance_grpo"),
    ],
)
def test_what_does_not_fit_dance_grpo_is_refused_naming_the_fix(overrides, key, fix):
    base = ["data.train_files=x.jsonl", *SMALL_LORA, *DANCE]
    assert validate(compose(base)).actor_rollout_ref.actor.diffusion_loss.loss_mode == "dance_grpo"
    with pytest.raises(ConfigError, match=rf"{key}.*Fix:.*{fix}"):
        validate(compose([*base, *overrides]))


def test_grpo_guard_and_flow_dppo_refuse_dance_sde():
    # their scale std_dev_t * sqrt_dt is the transition's std only under Flow-GRPO's sde
    for loss in ("grpo_guard", "flow_dppo"):
        overrides = [
            f"actor_rollout_ref.actor.diffusion_loss.loss_mode={loss}",
            "actor_rollout_ref.rollout.algo.sde_type=dance_sde",
        ]
        with pytest.raises(ConfigError, match=rf"sde_type: dance_sde does not fit loss_mode={loss}.*sde_type=sde"):
            validate(compose(["data.train_files=x.jsonl", *SMALL_LORA, *overrides]))


def assert_drawn_with_dance_sde(samples, sigmas) -> None:
    """Each stored window log-prob is the Gaussian density of a draw from DanceGRPO's step, whose std is
    ``1.2 sqrt(sigma - sigma_next)``: ``lp + log s + log sqrt(2 pi) = -mean(eps^2) / 2``, about -1/2 (Flow-GRPO's
    ``sde`` std is larger by ``sqrt(sigma / (1 - sigma))`` there, 0.5 to 1.1 away in log at these steps)."""
    for s in samples:
        r = s.result
        assert r.log_probs.shape == (2,) and r.window_latents.shape[0] == 3
        for j, lp in enumerate(r.log_probs.tolist()):
            i = r.window_start + j
            std = 1.2 * math.sqrt(float(sigmas[i] - sigmas[i + 1]))
            assert lp + math.log(std) + LOG_SQRT_2PI == pytest.approx(-0.5, abs=0.25), (i, lp)


@pytest.fixture(scope="module")
def sigmas():
    from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig

    return DiffusionPolicy("tiny:sd3", SamplingConfig(height=32, width=32, num_inference_steps=4)).sigmas


@pytest.mark.slow
def test_trains_stream_pipeline_one_step_off_and_sync(trainers, sigmas):
    trainer = trainers(
        *DANCE, *QUIET, "reward.streaming=true", "algorithm.rollout_correction.bypass_mode=true",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # the step's 2 groups: one optimizer step
    )  # fmt: skip
    metrics, samples = trainer.train_step(0)
    assert_drawn_with_dance_sde(samples, sigmas)
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # bypass: the rollout's policy, unmoved
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0
    step = through_lock_step_modes(trainer, 1, "actor/pg_loss")
    switch_mode(trainer, streaming=False, update_pipeline=False, one_step_off_policy=False)
    metrics, samples = trainer.train_step(step)  # sync: rollout, then scoring, then the update
    assert_drawn_with_dance_sde(samples, sigmas)
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0


@pytest.mark.slow
def test_trains_fully_async(trainers, sigmas):
    trainer = trainers(
        *DANCE, *QUIET, *POOL, "async_reward.fully_async=true", "async_training.staleness_threshold=1"
    )  # fmt: skip
    trained = record_trained_uids(trainer.ops)
    steps = [trainer.train_step(step) for step in range(3)]  # 3 spans a lagged draw
    for metrics, samples in steps:
        assert_drawn_with_dance_sde(samples, sigmas)
        assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0
    assert any(s.version < step for step, (_, samples) in enumerate(steps) for s in samples)  # a stale draw trained
    uids = [s.uid for _, samples in steps for s in samples]
    assert sorted(set(trained)) == sorted(set(uids)) and len(trained) == len(uids)  # each sample trained once
