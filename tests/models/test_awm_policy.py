"""AWM on the policy (no Ray): the update's gradient is ``algos.awm.awm_loss`` on the batch's tensors (the live, the
adapter-off and the anchor's velocities at the sample's own x_t), the step-start recompute of the matching
log-likelihood gives ratio 1 at unchanged weights, and an update moves each sample's matching error the way its
advantage says."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from omni_async.algos.awm import awm_loss
from omni_async.modality.image import ImageModality, forward_noise
from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig
from omni_async.sample import PromptRow, RewardOutcome, Sample
from omni_async.trainer.actor_core import TensorBatch

PROMPTS, SEEDS = ["a red sign", "a blue door", "a red sign"], [3, 4, 5]
DL = {"adv_clip_max": 5.0, "clip_ratio": 0.005, "ref_kl_coef": 0.01, "old_kl_coef": 0.5}
ACTOR = OmegaConf.create({"diffusion_loss": DL, "kl_loss_coef": 0.0, "ppo_micro_batch_size_per_gpu": None})
PG_ONLY = OmegaConf.merge(ACTOR, {"diffusion_loss": {"ref_kl_coef": 0.0, "old_kl_coef": 0.0}})
WEIGHTING = {"weighting": "ghuber", "ghuber_power": 0.25}  # ImageModality's defaults (the AWM recipes')


def make() -> DiffusionPolicy:
    torch.manual_seed(0)
    cfg = SamplingConfig(num_inference_steps=4, height=32, width=32, clean_latents=True)
    return DiffusionPolicy("tiny:sd3", cfg, lora_rank=4, lora_alpha=8, target_modules=["to_q", "to_v"])


def perturb_live(policy: DiffusionPolicy, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in policy.trainable_parameters():
            m.add_(scale * torch.randn(m.shape, generator=g))
    policy.refresh_working_weights()


def awm_batch(policy: DiffusionPolicy, advantages: list[float], mask: list[bool]) -> TensorBatch:
    """What ``StepOps.build_batch`` gives AWM: x0 and the prompt encodings from the rollout, the advantages, each
    sample's training steps and forward-noise seed."""
    results = policy.generate(PROMPTS, SEEDS)
    samples = [
        Sample(i, f"u{i}", PromptRow(p, "x", ""), seed, result=r, outcome=RewardOutcome("ok", 0.0))
        for i, (p, seed, r) in enumerate(zip(PROMPTS, SEEDS, results, strict=True))
    ]
    batch = ImageModality("awm").batch_tensors(samples)
    assert set(batch) >= {"latents_clean", "rm_scores", "prompt_embeds"} and "old_log_probs" not in batch
    batch["advantages"] = torch.tensor(advantages)
    batch["train_steps"] = torch.tensor([[1, 3], [0, 2], [2, 1]])
    batch["noise_seed"] = torch.tensor([11, 12, 13])
    batch["loss_mask"] = torch.tensor(mask)
    return TensorBatch(batch)


def recompute(modality: ImageModality, policy: DiffusionPolicy, batch: TensorBatch) -> torch.Tensor:
    """The step-start recompute of lp [B, T], as ``actor_core.compute_log_prob`` runs it (no gradient)."""
    with torch.no_grad():
        return modality.log_probs(policy, batch)


def grads_of(policy: DiffusionPolicy, fn) -> list[torch.Tensor]:
    for m in policy.trainable_parameters():
        m.grad = None
    out = fn()
    return out, [m.grad.clone() for m in policy.trainable_parameters()]


def test_awm_update_is_the_reference_loss_on_the_batch_tensors(no_network):
    """Recompute lp_old at the step's start, move the live weights (a later mini-batch of the step), then the
    update's gradient equals awm_loss's on velocities computed here from the same x_t: live, adapter-off, and the
    anchor (the old adapter, refreshed after the draw)."""
    policy = make()
    policy.init_old_policy()
    modality = ImageModality("awm", awm_weighting="ghuber", awm_ghuber_power=0.25)
    batch = awm_batch(policy, [4.0, -2.0, 7.0], [True, True, False])
    perturb_live(policy, 0.05, seed=3)
    policy.refresh_old(0.5)  # the anchor sits between the start and the live weights
    batch.batch["old_log_probs"] = recompute(modality, policy, batch)  # the step's start
    assert batch.batch["old_log_probs"].shape == (3, 2)
    perturb_live(policy, 0.5, seed=4)  # optimizer steps later

    metrics, got = grads_of(policy, lambda: modality.backward(policy, batch, batch.batch["loss_mask"], ACTOR))

    def reference():
        cond = policy.conditioning_from(batch.batch, batched=True)
        x0 = batch.batch["latents_clean"]
        noise = forward_noise(batch.batch["noise_seed"], x0, 2)
        losses = []
        for j in range(2):
            i = batch.batch["train_steps"][:, j]
            sigma = policy.sigmas[i]
            xt = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * noise[:, j]
            with torch.no_grad(), policy.old_policy():
                v_old = policy.velocity(cond, xt, i, per_sample=False)
            with torch.no_grad(), policy.reference():
                v_ref = policy.velocity(cond, xt, i, per_sample=False)
            loss, _ = awm_loss(
                policy.velocity(cond, xt, i, per_sample=False), x0, noise[:, j], sigma, batch.batch["advantages"],
                batch.batch["loss_mask"], old_log_prob=batch.batch["old_log_probs"][:, j], v_ref=v_ref, v_old=v_old,
                **DL, **WEIGHTING,
            )  # fmt: skip
            (loss / 2).backward()
            losses.append(float(loss.detach()))
        return losses

    losses, want = grads_of(policy, reference)
    assert metrics["actor/total_loss"] == pytest.approx(losses, rel=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-8) for a, b in zip(got, want, strict=True))
    assert sum(float(g.abs().sum()) for g in got) > 0
    assert all(v > 0 for v in metrics["actor/old_kl_loss"] + metrics["actor/ref_kl_loss"])
    assert any(abs(r - 1) > 1e-3 for r in metrics["actor/ratio_mean"])  # the weights moved since lp_old ...
    assert max(metrics["actor/pg_clipfrac"]) > 0  # ... one sample past the clip (its gradient: the KL terms only)


def test_recompute_at_unchanged_weights_is_ratio_one_and_the_bypass_gradient(no_network):
    """lp_old recomputed at the weights the update runs with: ratio 1, nothing clipped, and the same gradient as
    without a recompute (bypass_mode=true: lp_old = sg(lp))."""
    policy = make()
    modality = ImageModality("awm")
    batch = awm_batch(policy, [4.0, -2.0, 1.0], [True, True, True])
    perturb_live(policy, 0.05, seed=5)
    _, bypass = grads_of(policy, lambda: modality.backward(policy, batch, batch.batch["loss_mask"], PG_ONLY))
    batch.batch["old_log_probs"] = recompute(modality, policy, batch)
    metrics, recomputed = grads_of(policy, lambda: modality.backward(policy, batch, batch.batch["loss_mask"], PG_ONLY))
    assert metrics["actor/ratio_mean"] == pytest.approx([1.0, 1.0], abs=1e-5)
    assert metrics["actor/pg_clipfrac"] == [0.0, 0.0]
    assert all(torch.allclose(a, b, rtol=1e-3, atol=1e-8) for a, b in zip(bypass, recomputed, strict=True))


@pytest.mark.parametrize("sample", [0, 1])
def test_advantage_sign_moves_the_samples_matching_error(sample, no_network):
    """One gradient step on one sample's loss (the others masked): with A > 0 its matching log-likelihood at the
    same x_t rises (its weighted matching error falls), with A < 0 it falls."""
    policy = make()
    modality = ImageModality("awm")
    for advantage in (2.5, -2.5):
        mask = [i == sample for i in range(3)]
        batch = awm_batch(policy, [advantage] * 3, mask)
        start = [m.detach().clone() for m in policy.trainable_parameters()]
        before = recompute(modality, policy, batch)[sample]
        _, grads = grads_of(policy, lambda b=batch: modality.backward(policy, b, b.batch["loss_mask"], PG_ONLY))
        with torch.no_grad():
            for m, g in zip(policy.trainable_parameters(), grads, strict=True):
                m.sub_(1e-2 * g / max(float(torch.cat([x.flatten() for x in grads]).norm()), 1e-12))
        policy.refresh_working_weights()
        after = recompute(modality, policy, batch)[sample]
        moved = float((after - before).sum())
        assert moved > 0 if advantage > 0 else moved < 0, (advantage, before.tolist(), after.tolist())
        with torch.no_grad():  # back to the start for the other sign
            for m, s in zip(policy.trainable_parameters(), start, strict=True):
                m.copy_(s)
        policy.refresh_working_weights()
