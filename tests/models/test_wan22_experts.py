"""Wan 2.2's two experts on a tiny two-expert pipeline (``tiny:wan22``: ``transformer`` + ``transformer_2``,
``boundary_ratio`` 0.875): the expert of each step is diffusers' ``WanPipeline`` choice, per sample (also with the
UniPC scheduler Wan ships, whose integer timesteps decide the step at sigma 0.875); each expert's steps use its CFG
scale of the official pair (``guidance_scale``, ``guidance_scale_2``); LoRA trains both; the reference switches both
adapters off; the weights a sync ships hold both."""

from __future__ import annotations

import pytest
import torch
from diffusers import UniPCMultistepScheduler

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


def diffusers_velocity(pipe, x, t, emb, neg=None, scales=(1.0, 1.0)):
    """WanPipeline.__call__'s choice, written out: t >= boundary_ratio * num_train_timesteps -> transformer with
    guidance_scale, else transformer_2 with guidance_scale_2 (one timestep for the batch, as the pipeline denoises);
    ``neg``: the negative prompt's embeddings (CFG)."""
    boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
    model, scale = (pipe.transformer, scales[0]) if t >= boundary else (pipe.transformer_2, scales[1])

    def call(e):
        return model(hidden_states=x, timestep=t.expand(x.shape[0]), encoder_hidden_states=e, return_dict=False)[0]

    if neg is None:
        return call(emb)
    uncond = call(neg)
    return uncond + scale * (call(emb) - uncond)


def wan_unipc(policy: DiffusionPolicy, steps: int) -> DiffusionPolicy:
    """``policy`` on the scheduler Wan 2.2's checkpoints ship (UniPC on flow sigmas, A14B's flow_shift 3), at
    ``steps`` denoising steps."""
    policy.pipe.scheduler = UniPCMultistepScheduler(
        use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction"
    )
    return policy.with_sampling(num_inference_steps=steps)


def pipeline_experts(pipe, steps: int) -> list[str]:
    """The expert diffusers' own ``WanPipeline.__call__`` runs at each step (one call per step: CFG off)."""
    calls: list[str] = []
    hooks = [
        m.register_forward_pre_hook(lambda *_, name=name: calls.append(name))
        for name, m in (("transformer", pipe.transformer), ("transformer_2", pipe.transformer_2))
    ]
    try:
        pipe(
            "a cat",
            height=32,
            width=32,
            num_frames=5,
            num_inference_steps=steps,
            guidance_scale=1.0,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
        )
    finally:
        for h in hooks:
            h.remove()
    assert len(calls) == steps
    return calls


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


def lora_grads(policy: DiffusionPolicy, windows: list[range]) -> dict[str, float]:
    """The LoRA-B gradient norm on each expert after one FlowGRPO backward over two samples with these SDE windows
    (the update's path: ``modality.backward`` -> ``policy.step`` on the stored window latents)."""
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
    get_modality("image").backward(policy, batch, torch.ones(2, dtype=torch.bool), _ActorCfg())
    norm = {"transformer.": 0.0, "transformer_2.": 0.0}
    for n, p in policy.trainable.named_parameters():
        if "lora_B" in n and p.grad is not None:  # LoRA B starts at 0: only its gradient is non-zero at first
            norm[n.split(".")[0] + "."] += float(p.grad.norm())
    return norm


def test_lora_on_both_experts_trains_the_one_each_window_touches(no_network):
    policy = make()
    names = [n for n, _ in policy.trainable.named_parameters() if "lora_" in n]
    assert any(n.startswith("transformer.") for n in names) and any(n.startswith("transformer_2.") for n in names)
    assert len(policy.trainable_parameters()) == len(names)
    assert (
        policy.transformer not in policy.frozen_modules() and policy.pipe.transformer_2 not in policy.frozen_modules()
    )
    high_only = lora_grads(policy, [range(0, 2), range(0, 2)])  # steps 0, 1: t = 1000, 900
    assert high_only["transformer."] > 0 and high_only["transformer_2."] == 0
    across = lora_grads(policy, [range(1, 3), range(2, 4)])  # t = 900 | 750, 750 | 500: both experts
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


@pytest.mark.parametrize(("steps", "switch_step"), [(10, 3), (40, 12)])
def test_with_wans_unipc_the_sigma_0875_step_runs_and_trains_the_high_noise_expert_as_diffusers(
    steps, switch_step, no_network
):
    """Wan ships UniPC: its timesteps are integers, and at flow_shift 3 the step at sigma 0.875 is t = 875 >= 875,
    the high-noise expert's. The policy's float timestep of that step is 874.99994; the expert is still diffusers'
    (read from UniPC's own timesteps), for the rollout and for the update's gradient."""
    policy = wan_unipc(make(), steps)
    assert float(policy.sigmas[switch_step]) == pytest.approx(0.875) and float(policy.timesteps[switch_step]) < 875
    want = pipeline_experts(policy.pipe, steps)  # diffusers' WanPipeline itself, with its UniPC scheduler
    assert want[switch_step - 1 : switch_step + 2] == ["transformer", "transformer", "transformer_2"]
    got = ["transformer" if m is policy.pipe.transformer else "transformer_2" for m in policy.denoisers]
    assert got == want
    if steps == 10:  # the update: a window on that step trains the high-noise expert only
        grads = lora_grads(policy, [range(switch_step, switch_step + 1)] * 2)
        assert grads["transformer."] > 0 and grads["transformer_2."] == 0


def test_guidance_scale_2_is_the_low_noise_experts_cfg_scale(no_network):
    """diffusers' ``WanPipeline(guidance_scale=g, guidance_scale_2=g2)``: the high-noise expert's steps guide with
    g, the low-noise expert's with g2 (unset: g). The negative prompt runs when either scale is > 1."""
    policy = make(guidance_scale=3.0, guidance_scale_2=1.5)
    pipe = policy.pipe
    assert policy.cfg_scales == [3.0, 3.0, 1.5, 1.5]
    cond = policy.encode(["a cat", "a dog"])
    assert "negative_prompt_embeds" in cond
    x = torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for i in range(STEPS):
            want = diffusers_velocity(
                pipe, x, policy.timesteps[i], cond["prompt_embeds"], cond["negative_prompt_embeds"], (3.0, 1.5)
            )
            assert torch.allclose(policy.velocity(cond, x, i), want, atol=1e-5)
            batched = policy.velocity(policy.prepare(cond, batched=True), x, i, per_sample=False)
            assert torch.allclose(batched, want, atol=1e-5)
        # DiffusionNFT's batched per-sample steps: one sample on each expert, each with its own scale
        mixed = policy.velocity(policy.prepare(cond, batched=True), x, torch.tensor([1, 2]), per_sample=False)
        for r, i in enumerate([1, 2]):
            want = diffusers_velocity(
                pipe,
                x[r : r + 1],
                policy.timesteps[i],
                cond["prompt_embeds"][r : r + 1],
                cond["negative_prompt_embeds"][r : r + 1],
                (3.0, 1.5),
            )
            assert torch.allclose(mixed[r : r + 1], want, atol=1e-5)
    assert policy.with_sampling(guidance_scale_2=None).cfg_scales == [3.0] * STEPS  # diffusers: None = guidance_scale
    assert "negative_prompt_embeds" in policy.with_sampling(guidance_scale=1.0).encode(["a cat"])  # only g2 > 1


def test_guidance_scale_2_comes_from_the_config_and_is_refused_for_one_transformer(no_network):
    from omni_async.trainer.config import compose

    image = get_modality("image")
    key = "actor_rollout_ref.rollout"
    cfg = compose(
        [
            "data.train_files=x.jsonl",
            f"{key}.pipeline.guidance_scale_2=2",
            f"{key}.val_kwargs.pipeline.guidance_scale_2=1.5",
        ]
    )
    assert image.sampling_config(cfg).guidance_scale_2 == 2.0
    assert image.validation_sampling(cfg)["guidance_scale_2"] == 1.5
    assert image.sampling_config(compose(["data.train_files=x.jsonl"])).guidance_scale_2 is None
    with pytest.raises(ValueError, match=r"pipeline\.guidance_scale_2=2\.0 is the CFG scale of Wan 2\.2's low-noise"):
        DiffusionPolicy("tiny:wan", SamplingConfig(height=32, width=32, num_frames=5, guidance_scale_2=2.0))
