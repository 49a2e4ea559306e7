"""AWM (``loss_mode=awm``) through the trainer: its keys compose and what does not fit is refused naming the fix (as are
the loss modes not built, naming the one to use instead), and real Ray runs on tiny SD3, one trainer per layout: hybrid
(the step-start recompute of the matching log-likelihood, then bypass through the lock-step modes and sync) and fully
async on a rollout pool: the rollout samples with the live weights, never the EMA anchor; samples carry final latents
only; every group is trained once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import SMALL_LORA, drawn_latents, record_trained_uids, switch_mode, through_lock_step_modes
from verl import DataProto

from omni_async.modality import modality_of
from omni_async.sample import PromptRow, Sample
from omni_async.trainer.config import ConfigError, compose, validate
from omni_async.trainer.step_ops import StepOps, minibatches

# The AWM authors' recipe (config/dgx_awm.py, OCR) in this project's keys, the sizes aside.
AWM = [
    "actor_rollout_ref.model.algorithm=awm",
    "algorithm.trainer_type=direct_preference",
    'actor_rollout_ref.model.policy_state_adapters=["default","old"]',
    "actor_rollout_ref.actor.diffusion_loss.old_kl_coef=1.0",
    "actor_rollout_ref.actor.diffusion_loss.ref_kl_coef=0.003",
    "actor_rollout_ref.actor.diffusion_loss.clip_ratio=1.0",
    "actor_rollout_ref.actor.diffusion_loss.awm_weighting=ghuber",
    "actor_rollout_ref.actor.diffusion_loss.awm_ghuber_power=0.25",
    "algorithm.old_policy_decay_schedule=linear_to_0_3",
    "actor_rollout_ref.actor.diffusion_loss.awm_train_timesteps=2",  # a size: the authors' 6, 2 keeps the runs short
]


# The image config's keys here were written with LoRA (rank 8, alpha 16: this project's earlier default; verl's 0 is a
# full fine-tune, which keeps no frozen reference for ref_kl_coef / kl_loss_coef); a test of that passes lora_rank=0.
def valid(*overrides: str):
    return validate(compose(["data.train_files=x.jsonl", *SMALL_LORA, *overrides]))


def test_awm_composes_samples_final_latents_and_carries_its_weighting():
    cfg = valid(*AWM)
    modality = modality_of(cfg)
    assert cfg.actor_rollout_ref.actor.diffusion_loss.loss_mode == "awm"  # follows model.algorithm
    assert modality.final_latents and not modality.uses_window and modality.sampling_config(cfg).clean_latents
    assert modality.awm_weighting == {"weighting": "ghuber", "ghuber_power": 0.25}
    assert cfg.actor_rollout_ref.rollout.rollout_adapter == "default"  # the live weights sample
    # Without the anchor term AWM needs no second adapter.
    bare = valid("actor_rollout_ref.model.algorithm=awm", "algorithm.trainer_type=direct_preference")
    assert list(bare.actor_rollout_ref.model.policy_state_adapters) == ["default"]
    assert bare.actor_rollout_ref.actor.diffusion_loss.awm_weighting == "ghuber"


def test_awm_batch_trains_its_authors_stratified_steps_one_draw_per_minibatch():
    """The AWM authors' draw (``time_type=discrete_wo_init``): K steps, step k in the k-th stratum of 1 .. M
    (M = int(N x 0.9) = 9 of the 10 rollout steps, bounds floor(1 + 8 k / 3) = 1, 3, 6, 9), never step 0; one draw
    shared by every sample of a mini-batch (the authors share one per micro-batch), a new one per mini-batch, the same
    when the batch is built again (a resume)."""
    cfg = valid(
        *AWM,
        "actor_rollout_ref.rollout.num_inference_steps=10",
        "actor_rollout_ref.actor.diffusion_loss.awm_train_timesteps=3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    )
    assert cfg.actor_rollout_ref.actor.diffusion_loss.awm_timestep_fraction == 0.9  # the authors' default
    uids = [f"g{i % 4}" for i in range(12)]  # 4 groups of 3, interleaved
    samples = [Sample(i, u, PromptRow(f"p{u}", "x", ""), 1000 + 7 * i) for i, u in enumerate(uids)]

    def build() -> DataProto:
        batch = DataProto.from_dict(
            tensors={"loss_mask": torch.ones(12, dtype=torch.bool)},
            non_tensors={"uid": np.array(uids, dtype=object)},
        )
        StepOps(cfg, modality_of(cfg), None, None).forward_process_batch(batch, samples)
        return batch

    batch = build()
    steps = batch.batch["train_steps"]
    assert steps.shape == (12, 3)
    strata = [(1, 3), (3, 6), (6, 9)]
    assert all(lo <= s < hi for row in steps.tolist() for s, (lo, hi) in zip(row, strata, strict=True))
    draws = []
    for mb in minibatches(batch, 1):  # the trainer's split: one group per mini-batch here
        rows = mb.batch["train_steps"]
        assert (rows == rows[0]).all()  # shared by the mini-batch's samples
        draws.append(tuple(rows[0].tolist()))
    assert len(set(draws)) > 1  # each mini-batch its own draw
    assert torch.equal(build().batch["train_steps"], steps)  # from the samples' seeds: the same on a resume


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        # a loss mode runs under its algorithm (verl-omni's pairing)
        (["actor_rollout_ref.actor.diffusion_loss.loss_mode=dpo"], "loss_mode", "model.algorithm=dpo"),
        (["actor_rollout_ref.actor.diffusion_loss.loss_mode=awm"], "loss_mode", "model.algorithm=awm"),
        (["actor_rollout_ref.model.algorithm=awm"], "algorithm.trainer_type", "direct_preference"),
        ([*AWM, "actor_rollout_ref.model.policy_state_adapters=[default]"], "policy_state_adapters", '"old"'),
        (
            [*AWM, "actor_rollout_ref.actor.diffusion_loss.old_kl_coef=0"],
            "policy_state_adapters",
            'policy_state_adapters=["default"]',
        ),
        ([*AWM, "actor_rollout_ref.rollout.rollout_adapter=old"], "rollout.rollout_adapter", "rollout_adapter=default"),
        ([*AWM, "actor_rollout_ref.model.model_type=diffusion_nft_model"], "model.model_type", "diffusion_model"),
        ([*AWM, "actor_rollout_ref.rollout.calculate_log_probs=true"], "calculate_log_probs", "false"),
        ([*AWM, "actor_rollout_ref.actor.kl_loss_coef=0.01"], "kl_loss_coef", "ref_kl_coef=0.01"),
        (
            [*AWM, "algorithm.rollout_correction.bypass_mode=false", "algorithm.rollout_correction.rollout_is=token"],
            "rollout_is",
            "drop",
        ),
        ([*AWM, "algorithm.adv_mode=binary"], "algorithm.adv_mode", "continuous"),
        ([*AWM, "actor_rollout_ref.actor.diffusion_loss.awm_weighting=huber"], "awm_weighting", "uniform, ghuber"),
        ([*AWM, "actor_rollout_ref.actor.diffusion_loss.awm_ghuber_power=0"], "awm_ghuber_power", "> 0"),
        ([*AWM, "algorithm.timestep_fraction=0.5"], "algorithm.timestep_fraction", "awm_train_timesteps"),
        ([*AWM, "actor_rollout_ref.actor.diffusion_loss.awm_train_timesteps=0"], "awm_train_timesteps", "6"),
        (
            [*AWM, "actor_rollout_ref.actor.diffusion_loss.awm_timestep_fraction=0.05"],
            "awm_timestep_fraction",
            "0.9",
        ),  # the default 10 rollout steps: int(0.5) = 0 leaves no step
        ([*AWM[:2], "actor_rollout_ref.actor.diffusion_loss.old_kl_coef=-1"], "old_kl_coef", ">= 0"),
        (["actor_rollout_ref.actor.diffusion_loss.old_kl_coef=1.0"], "old_kl_coef", "loss_mode=awm"),
        ([*AWM, "actor_rollout_ref.model.lora_rank=0"], "ref_kl_coef", "lora_rank=8"),
        (
            [
                *AWM,
                "actor_rollout_ref.model.lora_rank=0",
                "actor_rollout_ref.actor.diffusion_loss.ref_kl_coef=0",
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.rollout.agent.num_workers=2",
                "data.train_batch_size=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            ],
            "model.lora_rank",
            "one actor rank",
        ),  # fmt: skip
    ],
)
def test_what_does_not_fit_awm_is_refused_naming_key_and_fix(overrides, key, fix):
    with pytest.raises(ConfigError) as err:
        valid(*overrides)
    assert key in str(err.value) and fix in str(err.value), str(err.value)


# ---- runs (real Ray, tiny SD3) -----------------------------------------------------------------------------------
RUN = [
    *AWM,
    "actor_rollout_ref.actor.optim.lr=5e-2",  # moves the live weights far from the start in one step
    "algorithm.old_policy_decay=1.0",  # the anchor stays the base model: a rollout reading it would draw the base's
    "trainer.log_image_freq=-1",
    "trainer.log_timeline_freq=-1",
]
POOL = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1"]
# One trainer per layout. Hybrid: three steps recomputing lp_old (two mini-batches per step: the second sees the
# weights the first moved, against lp_old from the step's start), one in bypass, then the pipeline, one-step-off and
# both (helpers.through_lock_step_modes), then sync (reward after the rollout). Disaggregated: fully async.
MODES = {
    "hybrid": [
        "reward.streaming=true",
        "algorithm.rollout_correction.bypass_mode=false",
        "trainer.total_training_steps=8",
    ],
    "fully_async_disaggregated": [*POOL, "async_reward.fully_async=true", "async_training.staleness_threshold=1"],
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_trains_sampling_with_the_live_policy(trainers, mode, tmp_path):
    trainer = trainers(*RUN, *MODES[mode])
    trained = record_trained_uids(trainer.ops)
    hybrid = mode == "hybrid"
    steps = [trainer.train_step(step) for step in range(2 if hybrid else 3)]  # fully async: 3 spans a lagged draw
    if hybrid:  # the weights step 2's samples are drawn with: the ones after step 1 (hybrid, lock-step)
        trainer.placement.actor_wg.save_checkpoint(str(tmp_path / "ckpt"))
        steps.append(trainer.train_step(2))
        # bypass from here (pi_old is read at each step): the lock-step modes after this one need it
        trainer.ops.cfg.algorithm.rollout_correction.bypass_mode = True
        steps.append(trainer.train_step(3))
    for metrics, samples in steps:
        assert all(s.result.log_probs.numel() == 0 and s.result.window_latents.numel() == 0 for s in samples)
        assert all(s.result.latents_clean is not None for s in samples)
        assert metrics["old_policy/updated"] == 1.0 and metrics["old_policy/moved_l2"] == 0.0  # the anchor held
        assert {"actor/pg_loss", "actor/fm_loss", "actor/ref_kl_loss"} <= set(metrics)
        assert "actor/policy_loss" not in metrics  # DiffusionNFT's
    # The live weights left the frozen anchor, and the anchor term says so.
    assert all(metrics["actor/old_kl_loss"] > 0 for metrics, _ in steps[1:])
    ratios = [metrics["actor/ratio_mean"] for metrics, _ in steps]
    bypassed = ratios[3:] if hybrid else ratios
    assert bypassed == [1.0] * len(bypassed)  # bypass: lp_old = sg(lp), ratio 1
    if hybrid:  # lp_old recomputed at the step's start: the second mini-batch's ratio moved
        assert any(abs(r - 1) > 1e-4 for r in ratios[:3])
        drawn = steps[2][1]
        state = torch.load(tmp_path / "ckpt" / "actor.pt", weights_only=True)
        got = torch.stack([s.result.latents_clean for s in drawn])
        assert (got - drawn_latents(drawn, state["weights"])).abs().max() < 1e-4  # the live weights drew them
    later = [s for _, samples in steps for s in samples if s.version >= 1]
    assert later
    got = torch.stack([s.result.latents_clean for s in later])
    assert (got - drawn_latents(later)).abs().max() > 1e-2  # not the anchor's (= the base model's) samples
    uids = [s.uid for _, samples in steps for s in samples]
    assert sorted(set(trained)) == sorted(set(uids)) and len(trained) == len(uids)  # each sample trained once
    if hybrid:
        step = through_lock_step_modes(trainer, len(steps), "actor/pg_loss")
        switch_mode(trainer, streaming=False, update_pipeline=False, one_step_off_policy=False)
        metrics, samples = trainer.train_step(step)  # sync: rollout, then scoring, then the update
        assert metrics["reward/failed"] == 0 and metrics["actor/grad_norm"] > 0 and metrics["actor/old_kl_loss"] > 0
        assert all(s.result.latents_clean is not None for s in samples)
