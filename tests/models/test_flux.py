"""FLUX.1 (``FluxPipeline``) as a policy, on ``tiny:flux`` (FLUX.1-dev's layout: the guidance embedding, 2x2-packed
tokens, CLIP + T5): the rollout is diffusers' own sampling, the SDE window's log-probs recompute, packing does not
change a log-prob, the guidance is an embedding (no negative prompt) and true CFG only when asked; ``random:flux.1_dev``
is the published 12 B architecture."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omni_async.algos.loss import flow_grpo_loss
from omni_async.algos.sde import sde_step_with_logprob
from omni_async.modality.image import ImageModality
from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig, sample_generators
from omni_async.trainer.actor_core import TensorBatch

PROMPTS = ["a red sign", "a much longer prompt about a blue shop sign"]


def make(**sampling) -> DiffusionPolicy:
    # T5's sequence cut to 32 tokens (pipeline.max_sequence_length; FluxPipeline's default 512) keeps the tests fast
    cfg = SamplingConfig(height=32, width=32, num_inference_steps=4, guidance_scale=3.5, max_sequence_length=32)
    policy = DiffusionPolicy("tiny:flux", cfg, lora_rank=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"])
    return policy.with_sampling(**sampling)


@pytest.fixture(scope="module")
def policy():
    return make()


@pytest.mark.parametrize("sampling", [{"guidance_scale": 3.5}, {"guidance_scale": 1.0, "true_cfg_scale": 4.0}])
def test_ode_rollout_is_flux_pipelines_own_sampling(policy, sampling, no_network):
    """No SDE window: the policy's samples are diffusers' ``FluxPipeline.__call__``'s for the same seeds (its
    schedule with the dynamic shift, guidance embedding, position ids, true CFG with an empty negative prompt, the
    unpacking and the VAE's scale and shift)."""
    p = policy.with_sampling(**sampling)
    ours = p.rollout(PROMPTS, [3, 4], None).images
    neg = {"negative_prompt": [""] * 2} if sampling.get("true_cfg_scale") else {}
    theirs = p.pipe(
        prompt=PROMPTS, height=32, width=32, num_inference_steps=4, generator=sample_generators([3, 4]),
        max_sequence_length=32, output_type="np", **sampling, **neg,
    ).images  # fmt: skip
    assert ours.shape == (2, 32, 32, 3)
    assert abs(ours.astype(float) - (theirs * 255).round()).max() <= 1


def test_window_log_probs_recompute_and_the_first_ratio_is_one(policy):
    """Per-sample windows in one batch: the trainer's recompute gives the rollout's log-probs, so the first update's
    importance ratio is 1 to float rounding."""
    windows = [range(0, 2), range(1, 3)]
    out = policy.rollout(PROMPTS, seeds=[3, 4], window=windows)
    assert out.window_latents.shape == (2, 3, 4, 16)  # packed: (32 / 16)^2 tokens of 4 x 2 x 2 channels
    batch = TensorBatch(
        {"window_latents": out.window_latents, "window_start": torch.tensor(out.window_starts), **out.conditioning}
    )
    again = ImageModality().log_probs(policy, batch)
    assert (again - out.log_probs).abs().max() < 1e-5
    _, metrics = flow_grpo_loss(
        again, out.log_probs, torch.ones(2), torch.ones(2, 2, dtype=torch.bool), clip_ratio=1e-4
    )
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def test_packing_does_not_change_the_log_prob(policy):
    """The SDE step on the packed tokens and on the unpacked [C, H, W] latents: packing permutes a latent's elements,
    so the step's Gaussian log-prob (a mean over elements) is the same."""
    out = policy.rollout(PROMPTS[:1], seeds=[5], window=range(1, 2))
    x, prev = out.window_latents[:, 0], out.window_latents[:, 1]
    v = policy.velocity(out.conditioning, x, 1)
    packed = sde_step_with_logprob(v, x, policy.sigmas[1], policy.sigmas[2], noise_level=0.7, prev_sample=prev)
    unpack = policy.pipe._unpack_latents  # noqa: SLF001 - diffusers' own layout function
    spatial = [unpack(t, 32, 32, policy.pipe.vae_scale_factor) for t in (v, x, prev)]
    assert spatial[0].shape == (1, 4, 4, 4)
    unpacked = sde_step_with_logprob(
        *spatial[:2], policy.sigmas[1], policy.sigmas[2], noise_level=0.7, prev_sample=spatial[2]
    )
    assert torch.allclose(packed.log_prob, unpacked.log_prob, atol=1e-6)
    assert torch.allclose(packed.log_prob, out.log_probs[:, 0], atol=1e-5)


def test_guidance_is_an_embedding_and_true_cfg_only_when_asked(policy):
    """``guidance_scale`` changes the sample through the transformer's guidance embedding, with one branch (no
    negative prompt encoded or run); ``true_cfg_scale`` > 1 adds the negative prompt."""
    cond = policy.encode(PROMPTS[:1])
    assert set(cond) == {"prompt_embeds", "pooled_prompt_embeds"}
    x = policy.adapter.init_latents(sample_generators([1]))
    low, high = policy.with_sampling(guidance_scale=1.0).velocity(cond, x, 0), policy.velocity(cond, x, 0)
    assert (low - high).abs().max() > 1e-3
    assert {"negative_prompt_embeds", "negative_pooled_prompt_embeds"} <= set(
        policy.with_sampling(true_cfg_scale=4.0).encode(PROMPTS[:1])
    )


def test_guidance_scale_without_a_guidance_embedding_is_refused():
    """FLUX.1-schnell's transformer has no guidance embedding: diffusers would ignore guidance_scale silently."""
    from omni_async.models.diffusion_policy import _ADAPTERS

    pipe = SimpleNamespace(transformer=SimpleNamespace(config=SimpleNamespace(guidance_embeds=False)))
    with pytest.raises(ValueError, match=r"guidance_scale=3.5 .*guidance_embeds=False.*true_cfg_scale"):
        _ADAPTERS["FluxPipeline"](pipe, SamplingConfig(guidance_scale=3.5))
    _ADAPTERS["FluxPipeline"](pipe, SamplingConfig(guidance_scale=1.0))  # the default is accepted


def test_random_flux_1_dev_is_the_published_12b_architecture():
    """``random:flux.1_dev``'s components on the meta device: FLUX.1-dev's 11.9 B transformer with its guidance
    embedding, CLIP-L and T5-XXL; an unknown override key is refused naming it."""
    from omni_async.models import random_models
    from omni_async.models.published import build

    parts = random_models.configs("flux.1_dev")
    assert random_models.FAMILIES["flux.1_dev"] == "FluxPipeline"
    counts = {name: sum(p.numel() for p in build(*spec).parameters()) for name, spec in parts.items()}
    assert abs(counts["transformer"] / 11.9e9 - 1) < 0.01
    assert abs(counts["text_encoder_2"] / 4.76e9 - 1) < 0.01 and 0.1e9 < counts["text_encoder"] < 0.15e9
    assert 0.07e9 < counts["vae"] < 0.1e9
    problems = random_models.override_problems("flux.1_dev", {"transformer": {"num_single_layers": 1, "depth": 2}})
    assert len(problems) == 1 and "transformer.depth" in problems[0]
    shrunk = {"transformer": {"num_layers": 1, "num_single_layers": 1}, "text_encoder_2": {"num_layers": 1}}
    pipe = random_models.build_pipeline("random:flux.1_dev", shrunk, device="meta", dtype=torch.bfloat16)
    assert type(pipe).__name__ == "FluxPipeline" and pipe.transformer.config.guidance_embeds
    assert len(pipe.transformer.single_transformer_blocks) == 1
    assert pipe.text_encoder_2.config.d_model == 4096 and pipe.tokenizer_2 is not None


def _window_grads(policy: DiffusionPolicy) -> dict[str, torch.Tensor]:
    """Each trained weight's gradient of one window step's log-prob (the update's forward)."""
    out = policy.rollout(PROMPTS[:1], [5], range(1, 2))
    log_prob = policy.step(out.conditioning, out.window_latents[:, 0], 1, prev_sample=out.window_latents[:, 1]).log_prob
    named = [(n, p) for n, p in policy.trainable.named_parameters() if p.requires_grad]
    return dict(zip([n for n, _ in named], torch.autograd.grad(log_prob.sum(), [p for _, p in named]), strict=True))


def test_lora_and_full_fine_tune_train_both_block_kinds(policy):
    """LoRA on to_q / to_k / to_v trains the dual-stream and the single-stream blocks; a full fine-tune (lora_rank=0)
    trains every weight the step uses, the guidance embedding's included."""
    lora = _window_grads(policy)
    for blocks in ("transformer_blocks.0.", "single_transformer_blocks.0."):
        assert any(n.startswith(blocks) and "lora_B" in n and g.abs().max() > 0 for n, g in lora.items()), blocks
    cfg = SamplingConfig(height=32, width=32, num_inference_steps=4, guidance_scale=3.5, max_sequence_length=32)
    full = _window_grads(DiffusionPolicy("tiny:flux", cfg, lora_rank=0))
    assert not any("lora" in n for n in full)
    assert all(g.abs().max() > 0 for n, g in full.items() if "guidance_embedder" in n)
    assert any("guidance_embedder" in n for n in full)
