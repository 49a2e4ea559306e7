"""Wan 2.2's two experts on a tiny two-expert pipeline (``tiny:wan22``: ``transformer`` + ``transformer_2``,
``boundary_ratio`` 0.875): the expert of each step is diffusers' ``WanPipeline`` choice, per sample; LoRA trains
both; the reference switches both adapters off; the weights a sync ships hold both."""

from __future__ import annotations

import torch

from omni_async.modality import get_modality
from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig
from omni_async.models.experts import ExpertPair
from omni_async.trainer.actor_core import TensorBatch

STEPS = 4  # tiny scheduler shift 3: sigmas 1, 0.9, 0.75, 0.5 -> timesteps 1000, 900 (high noise), 750, 500 (low)


def make(**kw) -> DiffusionPolicy:
    torch.manual_seed(0)
    return DiffusionPolicy(
        "tiny:wan22",
        SamplingConfig(height=32, width=32, num_frames=5, num_inference_steps=STEPS, noise_level=0.7, **kw),
        lora_rank=4,
        lora_alpha=8,
        target_modules=["to_q", "to_k", "to_v", "to_out.0"],
    )


def diffusers_velocity(pipe, x, t, emb):
    """WanPipeline.__call__'s choice, written out: t >= boundary_ratio * num_train_timesteps -> transformer, else
    transformer_2 (one timestep for the batch, as the pipeline denoises)."""
    boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
    model = pipe.transformer if t >= boundary else pipe.transformer_2
    return model(hidden_states=x, timestep=t.expand(x.shape[0]), encoder_hidden_states=emb, return_dict=False)[0]


def test_each_step_runs_the_expert_diffusers_picks_per_sample(no_network):
    policy = make()
    pipe = policy.pipe
    assert isinstance(policy.trainable, ExpertPair) and pipe.config.boundary_ratio == 0.875
    assert [float(t) for t in policy.timesteps] == [1000.0, 900.0, 750.0, 500.0]
    cond = policy.encode(["a cat", "a dog"])
    x = torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for i in range(STEPS):
            want = diffusers_velocity(pipe, x, policy.timesteps[i], cond["prompt_embeds"])
            assert torch.allclose(policy.velocity(cond, x, i), want, atol=1e-5)
        # Two samples at different steps (their SDE windows start apart): one on each side of the boundary.
        mixed = policy.velocity(cond, x, torch.tensor([1, 2]))
        for r, i in enumerate([1, 2]):
            want = diffusers_velocity(pipe, x[r : r + 1], policy.timesteps[i], cond["prompt_embeds"][r : r + 1])
            assert torch.allclose(mixed[r : r + 1], want, atol=1e-5)
        # The experts really differ, so the choice is visible.
        other = pipe.transformer_2(
            hidden_states=x,
            timestep=policy.timesteps[0].expand(2),
            encoder_hidden_states=cond["prompt_embeds"],
            return_dict=False,
        )[0]
        assert not torch.allclose(policy.velocity(cond, x, 0), other, atol=1e-3)


def test_lora_on_both_experts_trains_the_one_each_window_touches(no_network):
    policy = make()
    names = [n for n, _ in policy.trainable.named_parameters() if "lora_" in n]
    assert any(n.startswith("transformer.") for n in names) and any(n.startswith("transformer_2.") for n in names)
    assert len(policy.trainable_parameters()) == len(names)
    assert (
        policy.transformer not in policy.frozen_modules() and policy.pipe.transformer_2 not in policy.frozen_modules()
    )
    modality = get_modality("image")

    def lora_grads(windows):
        prompts = ["a cat", "a dog"]
        out = policy.rollout(prompts, [3, 4], windows)
        cond = policy.encode(prompts)
        batch = TensorBatch(
            {
                "window_latents": out.window_latents,
                "window_start": torch.tensor(out.window_starts),
                "old_log_probs": out.log_probs,
                "advantages": torch.tensor([1.0, -1.0]),
                **{k: v for k, v in cond.items() if v is not None},
            }
        )
        for p in policy.trainable_parameters():
            p.grad = None
        modality.backward(policy, batch, torch.ones(2, dtype=torch.bool), _ActorCfg())
        norm = {"transformer.": 0.0, "transformer_2.": 0.0}
        for n, p in policy.trainable.named_parameters():
            if "lora_B" in n and p.grad is not None:  # LoRA B starts at 0: only its gradient is non-zero at first
                norm[n.split(".")[0] + "."] += float(p.grad.norm())
        return norm

    high_only = lora_grads([range(0, 2), range(0, 2)])  # steps 0, 1: t = 1000, 900
    assert high_only["transformer."] > 0 and high_only["transformer_2."] == 0
    across = lora_grads([range(1, 3), range(2, 4)])  # t = 900 | 750, 750 | 500: both experts
    assert across["transformer."] > 0 and across["transformer_2."] > 0


def test_reference_and_weight_sync_cover_both_experts(no_network):
    policy = make()
    with torch.no_grad():
        for n, p in policy.trainable.named_parameters():
            if "lora_B" in n:
                p.fill_(0.05)
    state = policy.weights_state_dict()
    assert any(k.startswith("transformer_2.") for k in state) and any(k.startswith("transformer.") for k in state)
    fresh = make()
    fresh.load_weights_state_dict(state)
    cond = policy.encode(["a cat"])
    x = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for i in (0, 3):  # one step per expert
            assert torch.allclose(fresh.velocity(cond, x, i), policy.velocity(cond, x, i), atol=1e-6)
            with policy.reference():
                ref = policy.velocity(cond, x, i)
            base = diffusers_velocity(make().pipe, x, policy.timesteps[i], cond["prompt_embeds"])
            assert torch.allclose(ref, base, atol=1e-6)  # adapter off on the expert that ran = the base model
            assert not torch.allclose(policy.velocity(cond, x, i), base, atol=1e-4)


class _DiffusionLoss:
    clip_ratio = 0.2


class _ActorCfg:
    diffusion_loss = _DiffusionLoss
    kl_loss_coef = 0.0
