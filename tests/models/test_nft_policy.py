"""DiffusionNFT on the policy (no Ray): the ODE rollout's payload, the old policy (a second LoRA adapter, or a full
fine-tune's EMA copy), and the update's loss against the reference formula on the same tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from omni_async.algos.diffusion_nft import forward_noised, nft_loss, optimality_probability
from omni_async.modality.image import ImageModality, forward_noise
from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig
from omni_async.sample import PromptRow, RewardOutcome, Sample
from omni_async.trainer.actor_core import TensorBatch

PROMPTS, SEEDS = ["a red sign", "a blue door", "a red sign"], [3, 4, 5]
DL = {"mix_beta": 0.3, "adv_clip_max": 5.0, "adaptive_weight_min": 1e-5, "ref_kl_coef": 0.01, "clip_ratio": 1e-4}
ACTOR = OmegaConf.create({"diffusion_loss": DL, "kl_loss_coef": 0.0, "ppo_micro_batch_size_per_gpu": None})


def make(lora_rank: int = 4, name: str = "sd3", **sampling) -> DiffusionPolicy:
    torch.manual_seed(0)
    frames = 5 if name.startswith("wan") else 1
    cfg = SamplingConfig(num_inference_steps=4, height=32, width=32, num_frames=frames, clean_latents=True, **sampling)
    return DiffusionPolicy(f"tiny:{name}", cfg, lora_rank=lora_rank, lora_alpha=8, target_modules=["to_q", "to_v"])


def perturb_live(policy: DiffusionPolicy, scale: float, seed: int) -> None:
    """Move the live trainable weights (the fp32 masters, rounded into the working copy), as an optimizer would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in policy.trainable_parameters():
            m.add_(scale * torch.randn(m.shape, generator=g))
    policy.refresh_working_weights()


def test_ode_rollout_carries_clean_latents_and_no_window(no_network):
    policy = make()
    results = policy.generate(PROMPTS, SEEDS)
    for r in results:
        assert r.log_probs.numel() == 0 and r.window_latents.numel() == 0  # nothing of an SDE window
        assert r.latents_clean is not None and r.latents_clean.dtype == torch.float32
    # The clean latents are what the image decodes from.
    x0 = torch.stack([r.latents_clean for r in results])
    pixels = ((policy.adapter.decode(x0).float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).movedim(1, -1)
    assert np.abs(pixels.numpy().astype(int) - np.stack([r.pixels for r in results])).max() <= 1


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_old_policy_refresh_moves_by_one_minus_decay_and_samples_with_old(lora_rank, no_network):
    policy = make(lora_rank)
    policy.init_old_policy()
    x = torch.randn(2, *policy.adapter.init_latents([torch.Generator().manual_seed(1)])[0].shape)
    cond = policy.encode(PROMPTS[:2])
    with torch.no_grad():
        v0 = policy.velocity(cond, x, 1)
    perturb_live(policy, 0.05, seed=2)
    with torch.no_grad():
        v_live = policy.velocity(cond, x, 1)
        with policy.old_policy():
            v_old = policy.velocity(cond, x, 1)
        v_live_again = policy.velocity(cond, x, 1)
    assert (v_live - v0).abs().max() > 1e-3  # the live weights moved ...
    assert torch.allclose(v_old, v0, atol=1e-6)  # ... the old policy did not
    assert torch.equal(v_live, v_live_again)  # and the block restored the live weights
    old_before = {k: v.clone() for k, v in policy.old_state_dict().items()}
    live = dict(zip(policy._trainable_names, [m.detach().clone() for m in policy.trainable_parameters()], strict=True))
    moved = policy.refresh_old(0.75)
    after = policy.old_state_dict()
    gap_l2 = sum(((live[k] - old_before[k]) ** 2).sum() for k in live) ** 0.5
    for k in live:  # old <- 0.75 old + 0.25 theta: exactly a quarter of the gap
        assert torch.allclose(after[k] - old_before[k], 0.25 * (live[k] - old_before[k]), atol=1e-7)
    assert moved == pytest.approx(0.25 * float(gap_l2), rel=1e-4)
    # The rollout weights a replica would load are the old ones (same keys as the live weights).
    views = policy.old_weights_views()
    assert set(views) == set(policy.weights_views())
    policy.refresh_old(0.0)  # a copy: the old policy now predicts as the live one
    with torch.no_grad(), policy.old_policy():
        assert torch.allclose(policy.velocity(cond, x, 1), v_live, atol=1e-6)


def nft_batch(policy: DiffusionPolicy, scores: list[float], steps: list[list[int]]) -> TensorBatch:
    results = policy.generate(PROMPTS, SEEDS)
    samples = [
        Sample(i, f"u{i}", PromptRow(p, "x", ""), seed, result=r, outcome=RewardOutcome("ok", score))
        for i, (p, seed, r, score) in enumerate(zip(PROMPTS, SEEDS, results, scores, strict=True))
    ]
    batch = ImageModality("diffusion_nft").batch_tensors(samples)
    adv = torch.tensor(scores) - torch.tensor(scores).mean()
    batch["reward_prob"] = optimality_probability(adv, adv_clip_max=5.0).unsqueeze(-1)
    batch["train_steps"] = torch.tensor(steps)
    batch["noise_seed"] = torch.tensor([11, 12, 13])
    batch["loss_mask"] = torch.tensor([True, True, False])
    return TensorBatch(batch)


def test_nft_update_is_the_reference_formula_with_the_trainers_current_old(no_network):
    """The update's gradient equals nft_loss's on velocities computed here from the same x_t, with v_old from the
    trainer's *current* old policy: the old policy is refreshed after the samples were drawn (a fully async sample
    drawn by an older old), and the loss reads the refreshed one."""
    policy = make()
    policy.init_old_policy()
    batch = nft_batch(policy, [1.0, -2.0, 0.5], [[1, 3], [0, 2], [2, 1]])
    perturb_live(policy, 0.05, seed=3)
    old_at_draw = policy.old_state_dict()
    policy.refresh_old(0.5)  # the old policy moves after the draw: the loss must use this one
    perturb_live(policy, 0.05, seed=4)
    modality = ImageModality("diffusion_nft")

    for p in policy.trainable.parameters():
        p.grad = None
    metrics = modality.backward(policy, batch, batch.batch["loss_mask"], ACTOR)
    got = [m.grad.clone() for m in policy.trainable_parameters()]

    # The reference: the same x_t (the sample's own noise), velocities of the live / current old / adapter-off model.
    for m in policy.trainable_parameters():
        m.grad = None
    cond = policy.conditioning_from(batch.batch, batched=True)
    x0 = batch.batch["latents_clean"]
    noise = forward_noise(batch.batch["noise_seed"], x0, 2)
    losses = []
    for j in range(2):
        i = batch.batch["train_steps"][:, j]
        sigma = policy.sigmas[i]
        xt = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * noise[:, j]
        assert torch.allclose(xt, forward_noised(x0, sigma, noise[:, j]))
        with torch.no_grad(), policy.old_policy():
            v_old = policy.velocity(cond, xt, i, per_sample=False)
        with torch.no_grad(), policy.reference():
            v_ref = policy.velocity(cond, xt, i, per_sample=False)
        loss, _ = nft_loss(
            policy.velocity(cond, xt, i, per_sample=False), v_old, x0, xt, sigma, batch.batch["reward_prob"].reshape(-1),
            batch.batch["loss_mask"], v_ref=v_ref, **{k: v for k, v in DL.items() if k != "clip_ratio"},
        )  # fmt: skip
        (loss / 2).backward()
        losses.append(float(loss.detach()))
    want = [m.grad.clone() for m in policy.trainable_parameters()]
    assert metrics["actor/total_loss"] == pytest.approx(losses, rel=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-8) for a, b in zip(got, want, strict=True))
    assert sum(float(g.abs().sum()) for g in got) > 0
    # The old policy that drew the samples gives another loss: the update did not read it.
    policy.load_old_state_dict(old_at_draw)
    for m in policy.trainable_parameters():
        m.grad = None
    stale = modality.backward(policy, batch, batch.batch["loss_mask"], ACTOR)
    stale_grads = [m.grad.clone() for m in policy.trainable_parameters()]
    # the anchor's distance to the live prediction, and the gradient, are another's
    assert abs(stale["actor/old_deviate"][0] - metrics["actor/old_deviate"][0]) > 0.1 * metrics["actor/old_deviate"][0]
    assert max(float((a - b).abs().max()) for a, b in zip(got, stale_grads, strict=True)) > 1e-3 * max(
        float(g.abs().max()) for g in got
    )


@pytest.mark.parametrize("name", ["sd3", "qwen_image", "wan22"])
def test_masked_sample_and_micro_batches_give_the_same_gradient(name, no_network):
    """A sample's x_t comes from its own noise seed, so splitting the batch does not change the gradient; on each
    family's latents (SD3 spatial, Qwen-Image packed tokens, Wan 2.2 video with two experts, both with an old
    adapter)."""
    from omni_async.trainer.actor_core import accumulate_gradients

    policy = make(name=name)
    policy.init_old_policy()
    batch = nft_batch(policy, [1.0, -2.0, 0.5], [[1, 3], [0, 2], [2, 1]])
    perturb_live(policy, 0.05, seed=5)
    modality, grads = ImageModality("diffusion_nft"), []
    for micro in (None, 1):
        for m in policy.trainable_parameters():
            m.grad = None
        cfg = OmegaConf.merge(ACTOR, {"ppo_micro_batch_size_per_gpu": micro})
        accumulate_gradients(modality, policy, batch, cfg)
        grads.append([m.grad.clone() for m in policy.trainable_parameters()])
    assert sum(float(g.abs().sum()) for g in grads[0]) > 0
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(*grads, strict=True))


@pytest.mark.parametrize(
    ("name", "sampling"),
    [("sd3", {"guidance_scale": 3.0}), ("qwen_image", {"true_cfg_scale": 4.0}), ("wan22", {})],
)
def test_one_call_with_per_sample_steps_equals_one_call_per_sample(name, sampling, no_network):
    """The NFT update's batched transformer call (each sample at its own step) gives each sample's own velocity:
    with CFG (SD3, Qwen-Image's text padded to one length with a mask) and across Wan 2.2's experts (tiny:wan22's
    steps 0-1 run the high-noise expert, 2-3 the low-noise one: one call per expert)."""
    policy = make(name=name, **sampling)
    cond = policy.encode(PROMPTS)
    x = policy.adapter.init_latents([torch.Generator().manual_seed(s) for s in SEEDS])
    steps = torch.tensor([0, 3, 1])
    with torch.no_grad():
        batched = policy.velocity(policy.prepare(cond, batched=True), x, steps, per_sample=False)
        one_by_one = policy.velocity(cond, x, steps)
    assert (batched - one_by_one).abs().max() < 1e-4 * max(1.0, float(one_by_one.abs().max()))
    if name == "wan22":
        assert len({id(policy.denoisers[k]) for k in steps.tolist()}) == 2
