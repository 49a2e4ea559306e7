"""GRPO-Guard, Flow-DPPO and MixGRPO through the trainer (real Ray, tiny SD3), with verl-omni's recipe keys.

- stream (lock-step, staleness 0), hybrid: every step's one mini-batch starts at pi_theta = pi_old (bypass mode: the rollout's log-probs and
  window means), so the regulated ratio is 1 and Flow-DPPO's divergence 0; the update moves the weights;
- ``bypass_mode=false``: the recompute returns the log-probs *and* the means, the same start;
- one-step-off (the same GRPO-Guard trainer going on in that mode): a step trains samples drawn by the previous
  weights, so GRPO-Guard's bias term is > 0 (the stored means are the rollout's, not the trainer's);
- MixGRPO: every sample of step g runs the schedule's window of step g, and a resumed run draws the same windows;
- each loss then goes on through the pipeline, one-step-off and both (``helpers.through_lock_step_modes``)."""

from __future__ import annotations

import pytest
from helpers import switch_mode, through_lock_step_modes

from omni_async.algos.mix_grpo import mix_grpo_window

# verl-omni's examples/{grpoguard,flowdppo}_trainer/qwen_image/run_qwen_image_ocr_lora.sh, their loss keys as written
# there (model, sizes and reward: the tiny stand-ins of helpers.SMALL_IMAGE_TRAINER).
GUARD = [
    "actor_rollout_ref.actor.diffusion_loss.loss_mode=grpo_guard",
    "actor_rollout_ref.actor.diffusion_loss.clip_ratio=2e-6",
    "actor_rollout_ref.actor.diffusion_loss.adv_clip_max=5.0",
    "actor_rollout_ref.rollout.algo.noise_level=1.2",
    "actor_rollout_ref.rollout.algo.sde_type=sde",
]
DPPO = [
    "actor_rollout_ref.actor.diffusion_loss.loss_mode=flow_dppo",
    "actor_rollout_ref.actor.diffusion_loss.kl_mask_threshold=1e-5",
    "actor_rollout_ref.actor.diffusion_loss.add_kl_coefficient=True",
    "actor_rollout_ref.rollout.algo.noise_level=1.2",
    "actor_rollout_ref.rollout.algo.sde_type=sde",
]
# verl-omni's examples/mixgrpo_trainer/qwen_image/run_qwen_image_ocr_lora_mixgrpo.sh (the window envelope fits the
# 4 steps of the tiny stand-in: [0, 3) as SMALL_IMAGE_TRAINER's)
MIX = [
    "actor_rollout_ref.model.algorithm=mix_grpo",
    "actor_rollout_ref.actor.diffusion_loss.loss_mode=flow_grpo",
    "actor_rollout_ref.rollout.algo.sample_strategy=random",
    "actor_rollout_ref.rollout.algo.sde_window_seed=42",
    "actor_rollout_ref.rollout.algo.sde_window_size=2",
    "actor_rollout_ref.rollout.algo.noise_level=1.2",
]
QUIET = ["trainer.log_image_freq=-1", "trainer.log_timeline_freq=-1", "trainer.total_training_steps=10"]
ONE_MINIBATCH = ["actor_rollout_ref.actor.ppo_mini_batch_size=2"]  # the step's 2 groups: one optimizer step


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["grpo_guard", "flow_dppo"])
def test_sync_steps_start_at_the_rollouts_policy_and_train(trainers, loss):
    # GRPO-Guard at lr 5e-2 (the weights move far in one step) goes on one-step-off below; the sync assertions hold
    # at any lr (each step's one mini-batch starts at the rollout's policy).
    recipe = [*GUARD, "actor_rollout_ref.actor.optim.lr=5e-2"] if loss == "grpo_guard" else DPPO
    # bypass mode given: lock-step's default is verl-omni's recompute (tested below, decoupled), and one-step-off
    # must read the rollout's stored means
    trainer = trainers(
        *recipe, *QUIET, *ONE_MINIBATCH, "reward.streaming=true", "algorithm.rollout_correction.bypass_mode=true"
    )
    for step in range(2):
        metrics, samples = trainer.train_step(step)
        assert all(s.result.window_means is not None and s.result.window_means.shape[0] == 2 for s in samples)
        assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        assert metrics["actor/grad_norm"] > 0 and metrics["rollout/policy_version"] == step
        if loss == "grpo_guard":
            assert metrics["actor/ratio_mean_bias"] == pytest.approx(0.0, abs=1e-12)
        else:
            assert metrics["actor/kl_new_old_max"] == pytest.approx(0.0, abs=1e-12)
            assert metrics["actor/masked_fraction"] == 0.0
    if loss == "flow_dppo":
        decoupled_step_recomputes_the_means_with_the_log_probs(trainer, 2)
        trainer.ops.cfg.algorithm.rollout_correction.bypass_mode = True  # the overlap modes' default
        through_lock_step_modes(trainer, 3, "actor/pg_loss")
    else:
        one_step_off_trains_on_the_rollouts_stale_means(trainer, 2)
        switch_mode(trainer, one_step_off_policy=False)
        through_lock_step_modes(trainer, 4, "actor/pg_loss")


def decoupled_step_recomputes_the_means_with_the_log_probs(trainer, step: int) -> None:
    """``bypass_mode=false`` (read at each step): pi_old's log-probs and window means are recomputed by the actor
    before the update, and the step starts at ratio 1 / KL 0 against them."""
    trainer.ops.cfg.algorithm.rollout_correction.bypass_mode = False
    returned = []
    real = trainer.ops._actor_call

    def spy(method, data):
        out = real(method, data)
        if method == "compute_log_prob":
            returned.append(out)
        return out

    trainer.ops._actor_call = spy
    metrics, samples = trainer.train_step(step)
    assert len(returned) == 1 and set(returned[0]) == {"old_log_probs", "old_means"}
    assert returned[0]["old_means"].shape[:2] == (len(samples), 2)
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["actor/kl_new_old_max"] == pytest.approx(0.0, abs=1e-12) and metrics["timing_s/old_log_prob"] > 0


def one_step_off_trains_on_the_rollouts_stale_means(trainer, step: int) -> None:
    """The trainer goes on one-step-off (a test of its own, with a trainer of its own, until 2026-11-26): its second
    step trains samples drawn by the weights before the last update, so pi_old's stored means are not the trainer's:
    the bias term is > 0 and the regulated ratio leaves 1."""
    switch_mode(trainer, one_step_off_policy=True)
    rows = [trainer.train_step(k) for k in (step, step + 1)]
    assert all(s.result.window_means is not None for _, samples in rows for s in samples)
    metrics, samples = rows[1]
    assert metrics["async_reward/policy_version_lag"] == 1.0 and max(s.version for s in samples) < step + 1
    assert metrics["actor/ratio_mean_bias"] > 0 and metrics["actor/ratio_mean"] != pytest.approx(1.0, abs=1e-9)


@pytest.mark.slow
def test_mix_grpo_windows_follow_the_schedule_and_a_resumed_run_draws_the_same(trainers, tmp_path):
    ckpt = tmp_path / "ckpt"
    base = [*MIX, *QUIET, "reward.streaming=true", "trainer.resume_mode=auto", f"trainer.default_local_dir={ckpt}"]
    first = trainers(*base)
    windows = {}
    for step in range(3):
        if step == 2:
            first.save_checkpoint(2)
        _, samples = first.train_step(step)
        want = mix_grpo_window(
            step + 1, num_inference_steps=4, window_size=2, window_range=(0, 3), sample_strategy="random",
            sde_window_seed=42,
        )  # fmt: skip
        assert {tuple(s.window) for s in samples} == {(want.start, want.stop)}  # one window per step, shared
        assert all(s.result.window_start == want.start for s in samples)
        windows[step] = want
    assert len(set(windows.values())) > 1  # the schedule moves it

    first.ops.cfg.algorithm.rollout_correction.bypass_mode = True  # the overlap modes' default
    through_lock_step_modes(first, 3, "actor/pg_loss")

    resumed = trainers(*base)
    assert resumed.resume() == 2
    resumed.sync_weights(2)
    _, samples = resumed.train_step(2)
    assert {tuple(s.window) for s in samples} == {(windows[2].start, windows[2].stop)}
