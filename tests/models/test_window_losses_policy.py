"""GRPO-Guard and Flow-DPPO in the update, in process on tiny SD3: the rollout stores each SDE-window step's mean
(pi_old's, bypass mode) and only these losses carry it; the recompute returns the same means; the update's loss is
the ``algos`` function on the batch's tensors; before any optimizer step the regulated ratio is 1 and the new-old
divergence 0; a sample past Flow-DPPO's threshold that moves away is masked."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from omni_async.algos.flow_dppo import flow_dppo_loss
from omni_async.algos.grpo_guard import grpo_guard_loss
from omni_async.modality.image import ImageModality
from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig
from omni_async.sample import PromptRow, RewardOutcome, Sample
from omni_async.trainer.actor_core import TensorBatch, compute_log_prob

PROMPTS, SEEDS = ["a red sign", "a blue door", "a red sign", "say 12"], [3, 4, 5, 6]
ADV = torch.tensor([1.0, -0.5, 0.7, -1.2])
DL = {"clip_ratio": 2e-6, "adv_clip_max": 5.0, "kl_mask_threshold": 1e-5, "add_kl_coefficient": True}
ACTOR = OmegaConf.create({"diffusion_loss": DL, "kl_loss_coef": 0.0})


def make(window_means: bool) -> DiffusionPolicy:
    torch.manual_seed(0)
    cfg = SamplingConfig(num_inference_steps=4, height=32, width=32, noise_level=1.2, window_means=window_means)
    return DiffusionPolicy("tiny:sd3", cfg, lora_rank=4, lora_alpha=8, target_modules=["to_q", "to_v"])


def batch_of(policy: DiffusionPolicy, modality: ImageModality) -> TensorBatch:
    windows = [range(0, 2), range(1, 3), range(2, 4), range(0, 2)]  # per-sample windows, as the default draws
    results = policy.generate(PROMPTS, SEEDS, windows)
    samples = [
        Sample(i, f"u{i}", PromptRow(p, "x", ""), seed, result=r, outcome=RewardOutcome("ok", float(i)))
        for i, (p, seed, r) in enumerate(zip(PROMPTS, SEEDS, results, strict=True))
    ]
    batch = modality.batch_tensors(samples)
    batch["advantages"] = ADV.clone()
    batch["loss_mask"] = torch.tensor([True, True, True, False])
    return TensorBatch(batch)


def test_payload_carries_old_means_only_for_the_losses_that_read_them(no_network):
    for mode in ("flow_grpo", "diffusion_nft"):
        m = ImageModality(mode)
        assert not m.old_means and not m.sampling_config(_cfg(mode)).window_means
    policy = make(window_means=False)
    assert "old_means" not in batch_of(policy, ImageModality("flow_grpo")).batch
    assert all(r.window_means is None for r in policy.generate(PROMPTS[:1], SEEDS[:1], range(0, 2)))
    with pytest.raises(ValueError, match="grpo_guard needs each window step's mean"):
        batch_of(policy, ImageModality("grpo_guard"))
    for mode in ("grpo_guard", "flow_dppo"):
        m = ImageModality(mode)
        assert m.old_means and m.sampling_config(_cfg(mode)).window_means
        batch = batch_of(make(window_means=True), m).batch
        lat = batch["window_latents"]
        assert batch["old_means"].shape == (4, 2, *lat.shape[2:]) and batch["old_means"].dtype == torch.float32


def _cfg(loss_mode: str):
    from omni_async.trainer.config import compose

    algo = "diffusion_nft" if loss_mode == "diffusion_nft" else "flow_grpo"
    return compose(
        [
            "data.train_files=x.jsonl",
            f"actor_rollout_ref.model.algorithm={algo}",
            f"actor_rollout_ref.actor.diffusion_loss.loss_mode={loss_mode}",
        ]
    )


def test_rollout_means_are_the_recomputes_bit_for_bit(no_network):
    """The rollout's stored means are what the trainer's forward computes under the same weights: the bypass-mode
    pi_old means and the recompute's (``bypass_mode=false``) agree, and both losses then see ratio 1, divergence 0."""
    policy, modality = make(window_means=True), ImageModality("flow_dppo")
    batch = batch_of(policy, modality)
    got = compute_log_prob(modality, policy, batch, 2)  # in micro-batches of 2, as the worker does
    assert set(got) == {"old_log_probs", "old_means"}
    assert torch.equal(got["old_means"], batch.batch["old_means"])
    assert torch.allclose(got["old_log_probs"], batch.batch["old_log_probs"], atol=1e-6)
    assert isinstance(compute_log_prob(ImageModality("flow_grpo"), policy, batch), torch.Tensor)


def _reference(policy, batch, loss_mode: str) -> list[tuple[torch.Tensor, dict]]:
    """The loss per window step, computed here from the batch's tensors with the ``algos`` function."""
    b = batch.batch
    cond = policy.conditioning_from(b)
    starts, lat = b["window_start"], b["window_latents"]
    out = []
    for j in range(lat.shape[1] - 1):
        step = policy.step(cond, lat[:, j], starts + j, prev_sample=lat[:, j + 1])
        args = (step.log_prob, b["old_log_probs"][:, j], b["advantages"], b["loss_mask"])
        kw = {"mean": step.mean, "old_mean": b["old_means"][:, j], "std_dev_t": step.std_dev_t, "sqrt_dt": step.sqrt_dt}
        if loss_mode == "grpo_guard":
            out.append(grpo_guard_loss(*args, **kw, clip_ratio=DL["clip_ratio"]))
        else:
            out.append(flow_dppo_loss(*args, **kw, kl_mask_threshold=DL["kl_mask_threshold"]))
    return out


def _grads(policy) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in policy.trainable_parameters()]


def _zero(policy) -> None:
    for p in policy.trainable_parameters():
        p.grad = None


@pytest.mark.parametrize("loss_mode", ["grpo_guard", "flow_dppo"])
def test_update_is_the_algos_loss_on_the_batch_and_starts_at_ratio_one(loss_mode, no_network):
    policy, modality = make(window_means=True), ImageModality(loss_mode)
    batch = batch_of(policy, modality)
    _zero(policy)
    metrics = modality.backward(policy, batch, batch.batch["loss_mask"], ACTOR)
    got = _grads(policy)
    # Before any optimizer step: pi_theta = pi_old, so the regulated ratio is 1 and the divergence 0 at every step.
    assert metrics["actor/ratio_mean"] == pytest.approx([1.0, 1.0], abs=1e-6)
    if loss_mode == "grpo_guard":
        assert max(metrics["actor/ratio_mean_bias"]) == 0.0
    else:
        assert max(metrics["actor/kl_new_old_max"]) == 0.0 and max(metrics["actor/masked_fraction"]) == 0.0
    _zero(policy)
    ref = _reference(policy, batch, loss_mode)
    sum(loss for loss, _ in ref).div(len(ref)).backward()  # the window's steps are averaged
    want = _grads(policy)
    assert any(g.abs().max() > 0 for g in want)
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-9)
    assert metrics["actor/pg_loss"] == pytest.approx([float(m["actor/pg_loss"]) for _, m in ref], rel=1e-5)


def test_a_sample_past_the_kl_threshold_moving_away_is_masked(no_network):
    """Sample 0 (A > 0): its stored pi_old log-probs lowered (ratio e > 1) and its old means shifted (D far past the
    threshold): Flow-DPPO drops it, so its gradient is the one of the batch without it; sample 1 (A < 0, ratio e > 1:
    moving back) is shifted too and stays."""
    policy, modality = make(window_means=True), ImageModality("flow_dppo")
    batch = batch_of(policy, modality)
    b = batch.batch
    for i in (0, 1):
        b["old_log_probs"][i] -= 1.0
        b["old_means"][i] += 0.5
    _zero(policy)
    metrics = modality.backward(policy, batch, b["loss_mask"], ACTOR)
    got = _grads(policy)
    assert metrics["actor/pos_rm_fraction"] == pytest.approx([1 / 3, 1 / 3])
    assert metrics["actor/neg_rm_fraction"] == [0.0, 0.0] and min(metrics["actor/kl_mask_fraction"]) >= 2 / 3
    # The same batch with sample 0's advantage 0: the kept samples' gradient, divided over the same 3 kept samples.
    b["advantages"][0] = 0.0
    _zero(policy)
    modality.backward(policy, batch, b["loss_mask"], ACTOR)
    for g, w in zip(got, _grads(policy), strict=True):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-10)
