"""The trainer's advantages and loss mask (``StepOps.build_batch``) under the shipped configs and the recipe keys the
README names, checked against the references: verl's ``compute_grpo_outcome_advantage`` (text), flow_grpo's
``PerPromptStatTracker`` + zero-advantage filter of ``train_sd3.py`` and verl-omni's
``compute_flow_grpo_outcome_advantage`` + ``FlowGRPOLoss`` mean (images), the last two written out here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

from omni_async.algos.loss import flow_grpo_loss
from omni_async.modality import get_modality
from omni_async.sample import ImageResult, PromptRow, RewardOutcome, Sample, TextResult
from omni_async.trainer.config import compose, validate
from omni_async.trainer.step_ops import StepOps

ROW = PromptRow(prompt="p", data_source="x", ground_truth=None)


def build_batch(cfg, modality_name: str, samples: list[Sample]):
    return StepOps(cfg, get_modality(modality_name), None, None).build_batch(samples)


def text_samples(groups: list[list[float]]) -> list[Sample]:
    out = []
    for g, rewards in enumerate(groups):
        for k, r in enumerate(rewards):
            n_tokens = 1 + (len(out) % 3)  # responses of different lengths: the reward sits on the last token
            out.append(
                Sample(
                    index=len(out),
                    uid=f"0-{g}",
                    row=ROW,
                    seed=k,
                    outcome=RewardOutcome("ok", r),
                    result=TextResult([5, 6], list(range(7, 7 + n_tokens)), "r", torch.zeros(n_tokens)),
                )
            )
    return out


def image_samples(groups: list[list[float]], window_start: int = 1) -> list[Sample]:
    out = []
    for g, rewards in enumerate(groups):
        for k, r in enumerate(rewards):
            result = ImageResult(
                np.zeros((8, 8, 3), np.uint8),
                torch.zeros(3, 4),
                torch.zeros(2),
                {"prompt_embeds": torch.zeros(5, 6)},
                window_start=window_start,
            )
            out.append(
                Sample(
                    index=len(out),
                    uid=f"0-{g}",
                    row=ROW,
                    seed=k,
                    outcome=RewardOutcome("ok", r),
                    result=result,
                    window=(window_start, window_start + 2),
                )
            )
    return out


def test_text_advantages_are_verls_grpo_on_the_same_batch():
    """grpo_text_trainer sets verl's GRPO: unbiased group std, eps 1e-6, no clip. A group of 32 with one success
    has advantage (31/32) / sqrt(1/32) = 5.48 for it: a clip at 5 (the image default) would show."""
    cfg = validate(compose(["data.train_files=x.jsonl"], config_name="grpo_text_trainer"))
    groups = [[0.0, 0.0, 1.0, 1.0], [0.2, 0.9, 0.4, 0.3], [1.0] * 4, [0.0] * 31 + [1.0]]
    batch = build_batch(cfg, "text", text_samples(groups))
    b = batch.batch
    verl_adv, _ = compute_grpo_outcome_advantage(
        b["rm_scores"], b["response_mask"].float(), np.array(batch.non_tensor_batch["uid"], dtype=object)
    )
    ours = b["advantages"][:, None] * b["response_mask"]
    assert torch.allclose(ours, verl_adv, atol=1e-6, rtol=1e-6)
    assert b["advantages"].max().item() == pytest.approx((31 / 32) / (np.sqrt(1 / 32) + 1e-6), rel=1e-6)
    assert b["loss_mask"].all()  # a zero-std group stays in the loss (verl keeps it, with zero gradient)


def flow_grpo_advantages(rewards: np.ndarray, prompts: np.ndarray) -> np.ndarray:
    """flow_grpo ``PerPromptStatTracker(global_std=True).update``: per-prompt mean, ``np.std`` of the whole batch
    (biased) + 1e-4 (its SD3 recipes set ``config.sample.global_std = True``)."""
    adv = np.zeros_like(rewards)
    std = np.std(rewards) + 1e-4
    for p in np.unique(prompts):
        adv[prompts == p] = (rewards[prompts == p] - rewards[prompts == p].mean()) / std
    return adv


def verl_omni_advantages(rewards: torch.Tensor, prompts: np.ndarray) -> torch.Tensor:
    """verl-omni ``compute_flow_grpo_outcome_advantage`` (``global_std=True``, its default; eps 1e-4): per-prompt
    mean, ``torch.std`` of the batch (unbiased)."""
    std = torch.std(rewards)
    out = torch.empty_like(rewards)
    for p in np.unique(prompts):
        m = torch.from_numpy(prompts == p)
        out[m] = (rewards[m] - rewards[m].mean()) / (std + 1e-4)
    return out


GROUPS = [[1.0, 1.0, 1.0, 1.0], [0.0, 0.5, 1.0, 0.5], [0.2, 0.9, 0.4, 0.3]]  # a zero-std group; 0.5 = its mean


def test_flow_grpo_recipe_keys_reproduce_its_advantages_and_zero_advantage_filter():
    cfg = validate(
        compose(["data.train_files=x.jsonl", "algorithm.global_std=true", "algorithm.drop_zero_adv_samples=true"])
    )
    batch = build_batch(cfg, "image", image_samples(GROUPS))
    rewards = np.array([r for g in GROUPS for r in g])
    prompts = np.array(batch.non_tensor_batch["uid"])
    want = flow_grpo_advantages(rewards, prompts)
    assert batch.batch["advantages"].numpy() == pytest.approx(want, abs=1e-6)
    # train_sd3.py: samples whose advantage is 0 along the whole window are filtered out of the batch
    keep = np.abs(want) != 0
    assert keep.sum() == 6 and batch.batch["loss_mask"].numpy().tolist() == keep.tolist()
    # ... so the clipped loss is a mean over the others
    lp = torch.linspace(-0.3, 0.3, len(rewards))
    adv = torch.from_numpy(want).float()
    per_sample = torch.maximum(-adv * lp.exp(), -adv * lp.exp().clamp(0.8, 1.2))
    loss, _ = flow_grpo_loss(
        lp, torch.zeros_like(lp), batch.batch["advantages"], batch.batch["loss_mask"], clip_ratio=0.2
    )
    assert loss.item() == pytest.approx(per_sample[torch.from_numpy(keep)].mean().item(), rel=1e-5)


def test_verl_omni_recipe_keys_reproduce_its_advantages_and_keep_zero_advantages():
    cfg = validate(
        compose(["data.train_files=x.jsonl", "algorithm.global_std=true", "algorithm.adv_std_unbiased=true"])
    )
    batch = build_batch(cfg, "image", image_samples(GROUPS))
    rewards = torch.tensor([r for g in GROUPS for r in g])
    want = verl_omni_advantages(rewards, np.array(batch.non_tensor_batch["uid"]))
    assert torch.allclose(batch.batch["advantages"], want, atol=1e-6)
    assert batch.batch["loss_mask"].all()  # zero-advantage samples stay
    # FlowGRPOLoss: clamp(adv, -5, 5), then torch.mean over every sample
    lp = torch.linspace(-0.3, 0.3, len(rewards))
    adv = want.clamp(-5, 5)
    per_sample = torch.maximum(-adv * lp.exp(), -adv * lp.exp().clamp(0.8, 1.2))
    loss, _ = flow_grpo_loss(
        lp, torch.zeros_like(lp), batch.batch["advantages"], batch.batch["loss_mask"], clip_ratio=0.2
    )
    assert loss.item() == pytest.approx(per_sample.mean().item(), rel=1e-5)


def test_the_image_default_is_the_batch_wide_std_and_fully_async_keeps_it():
    """``algorithm.global_std`` defaults to true for images (flow_grpo's SD3 recipes, verl-omni's default and key):
    the advantages are flow_grpo's batch-wide ones. Text keeps verl's per-group std. Fully async trains a step's
    groups as one batch, so it takes the default; the mini-batch pipeline, which trains groups before the batch
    exists, is refused with it (its presets set false)."""
    from omni_async.trainer.config import ConfigError
    from omni_async.trainer.mode import MODE_OVERRIDES, fully_async_overrides, mode_of

    cfg = validate(compose(["data.train_files=x.jsonl"]))
    assert cfg.algorithm.global_std is True
    batch = build_batch(cfg, "image", image_samples(GROUPS))
    rewards = np.array([r for g in GROUPS for r in g])
    want = flow_grpo_advantages(rewards, np.array(batch.non_tensor_batch["uid"]))
    assert batch.batch["advantages"].numpy() == pytest.approx(want, abs=1e-6)
    assert (
        validate(compose(["data.train_files=x.jsonl"], config_name="grpo_text_trainer")).algorithm.global_std is False
    )
    # LoRA, as written (this project's earlier default): a full fine-tune (verl's rank 0, the default) overlaps the
    # update only in the split layout, or on a rollout pool with checkpoint_engine nccl
    lora = ["data.train_files=x.jsonl", "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]
    pool = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1"]
    fully = validate(compose([*lora, *pool, *fully_async_overrides(1)]))
    assert fully.algorithm.global_std is True and not mode_of(fully).pipelined
    with pytest.raises(ConfigError, match=r"^algorithm\.global_std: .*Fix: set algorithm\.global_std=false"):
        validate(compose([*lora, "async_reward.update_pipeline=true"]))
    for preset in ("stream+pipeline", "all"):
        assert mode_of(validate(compose([*lora, *MODE_OVERRIDES[preset]]))).pipelined


@pytest.mark.parametrize(("loss_mode", "clipped"), [("flow_grpo", True), ("grpo_guard", True), ("flow_dppo", False)])
def test_flow_dppo_takes_the_advantages_unclipped_as_verl_omnis_loss(loss_mode, clipped):
    """verl-omni clips the advantages to +-``diffusion_loss.adv_clip_max`` in ``FlowGRPOLoss`` and ``GRPOGuardLoss``,
    not in ``FlowDPPOLoss`` (its per-sample term is ``-A rho`` with ``A`` as given). With ``adv_clip_max`` 0.5 the
    batch's advantages are the group advantages clipped to [-0.5, 0.5] for the first two, unclipped for Flow-DPPO."""
    cfg = validate(
        compose(
            [
                "data.train_files=x.jsonl",
                "algorithm.global_std=true",
                "algorithm.adv_std_unbiased=true",
                "actor_rollout_ref.actor.diffusion_loss.adv_clip_max=0.5",
                f"actor_rollout_ref.actor.diffusion_loss.loss_mode={loss_mode}",
                "actor_rollout_ref.rollout.algo.sde_type=sde",
            ]
        )
    )
    samples = image_samples(GROUPS)
    for s in samples:
        s.result.window_means = torch.zeros(2, 4)
    batch = StepOps(cfg, get_modality("image", loss_mode), None, None).build_batch(samples)
    raw = verl_omni_advantages(torch.tensor([r for g in GROUPS for r in g]), np.array(batch.non_tensor_batch["uid"]))
    assert raw.abs().max() > 0.5  # the clip would show
    want = raw.clamp(-0.5, 0.5) if clipped else raw
    assert torch.allclose(batch.batch["advantages"], want, atol=1e-6)
