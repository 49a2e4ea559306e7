"""The diffusion policy on tiny Qwen-Image, SD3 and Wan: rollout, log-prob recompute, CFG, LoRA, reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch.overrides import TorchFunctionMode
from verl import DataProto

from omni_async.algos.loss import flow_grpo_loss
from omni_async.modality.image import ImageModality
from omni_async.models.diffusion_policy import (
    DiffusionPolicy,
    SamplingConfig,
    sample_generators,
    split_conditioning,
    window_noise,
)
from omni_async.sample import PromptRow, RewardOutcome, Sample
from omni_async.trainer.actor_core import TensorBatch

FAMILIES = {
    "qwen_image": dict(height=32, width=32),
    "sd3": dict(height=32, width=32),
    "wan": dict(height=32, width=32, num_frames=5),
}


def make(name: str, **sampling) -> DiffusionPolicy:
    torch.manual_seed(0)
    cfg = SamplingConfig(num_inference_steps=4, noise_level=0.7, **{**FAMILIES[name], **sampling})
    return DiffusionPolicy(
        f"tiny:{name}", cfg, lora_rank=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"]
    )


@pytest.mark.parametrize("name", list(FAMILIES))
def test_rollout_shapes_and_logprob_recompute(name, no_network):
    """Two samples with different SDE windows in one batch (verl-omni's per-row windows): the trainer's recompute
    (ImageModality.log_probs, per-sample window_start -> per-sample timesteps in one forward) gives the rollout's
    log-probs, and each row's window transitions score under the policy at that row's own steps."""
    policy = make(name)
    windows = [range(1, 3), range(2, 4)]
    out = policy.rollout(["a red sign", "a blue sign"], seeds=[3, 4], window=windows)
    frames = FAMILIES[name].get("num_frames")
    want = (2, frames, 32, 32, 3) if frames else (2, 32, 32, 3)
    assert out.images.shape == want and out.images.dtype == np.uint8
    assert out.window_latents.shape[1] == 3 and out.log_probs.shape == (2, 2) and out.window_starts == [1, 2]
    cond = policy.encode(["a red sign", "a blue sign"])
    batch = TensorBatch(
        {
            "window_latents": out.window_latents,
            "window_start": torch.tensor(out.window_starts),
            **{k: v for k, v in cond.items() if v is not None},
        }
    )
    assert (ImageModality().log_probs(policy, batch) - out.log_probs).abs().max() < 1e-5
    for r, w in enumerate(windows):
        for j in range(2):
            again = policy.step(
                {k: v[r : r + 1] for k, v in cond.items() if v is not None},
                out.window_latents[r : r + 1, j],
                w.start + j,
                prev_sample=out.window_latents[r : r + 1, j + 1],
            )
            assert (again.log_prob - out.log_probs[r, j]).abs().max() < 1e-5
            # First inner step: the same weights, so the importance ratio is exactly 1.
            _, metrics = flow_grpo_loss(
                again.log_prob,
                out.log_probs[r : r + 1, j],
                torch.tensor([1.0]),
                torch.ones(1, dtype=torch.bool),
                clip_ratio=0.2,
            )
            assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def test_sample_does_not_depend_on_batch_or_companions():
    """Not on the batch, nor on the companions' SDE windows: sample "x" alone with window [1, 3) equals "x" batched
    beside a sample whose window is [0, 2) (step 0 runs SDE for one row and ODE for the other)."""
    policy = make("sd3")
    alone = policy.rollout(["x"], [7], range(1, 3))
    together = policy.rollout(["y", "x"], [8, 7], [range(0, 2), range(1, 3)])
    # The float path is batch-shape invariant only to ~1e-7 (BLAS picks kernels by shape; measured on an AMD EPYC:
    # one pixel of 3072 one level apart), so the uint8 image may round a level differently; the latents and
    # log-probs below hold it to 1e-6.
    diff = np.abs(alone.images[0].astype(np.int16) - together.images[1].astype(np.int16))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (diff.max(), (diff > 0).mean())
    assert torch.allclose(alone.log_probs[0], together.log_probs[1], atol=1e-6)
    assert torch.allclose(alone.window_latents[0], together.window_latents[1], atol=1e-6)
    companion = policy.rollout(["y"], [8], range(0, 2))
    assert torch.allclose(companion.log_probs[0], together.log_probs[0], atol=1e-6)
    with pytest.raises(ValueError, match="one length"):
        policy.rollout(["y", "x"], [8, 7], [range(0, 2), range(1, 2)])


@pytest.mark.parametrize(
    "name,key", [("qwen_image", "true_cfg_scale"), ("sd3", "guidance_scale"), ("wan", "guidance_scale")]
)
def test_cfg_changes_the_sample(name, key):
    plain = make(name).rollout(["a cat"], [1], range(0, 1))
    guided_policy = make(name, **{key: 4.0})
    guided = guided_policy.rollout(["a cat"], [1], range(0, 1))
    assert not np.array_equal(plain.images, guided.images)
    cond = guided_policy.encode(["a cat"])  # recompute with CFG matches the rollout too
    again = guided_policy.step(cond, guided.window_latents[:, 0], 0, prev_sample=guided.window_latents[:, 1])
    assert (again.log_prob - guided.log_probs[:, 0]).abs().max() < 1e-5


def _branch(policy, name, x, t, row, prefix=""):
    """One CFG branch of one sample through the transformer alone: its own unpadded text, no mask, batch 1."""
    emb = row[f"{prefix}prompt_embeds"][None]
    if name == "qwen_image":
        f = policy.pipe.vae_scale_factor * 2
        return policy.transformer(
            hidden_states=x,
            timestep=(t / 1000).expand(1),
            guidance=None,
            encoder_hidden_states=emb,
            encoder_hidden_states_mask=None,
            img_shapes=[[(1, 32 // f, 32 // f)]],
            return_dict=False,
        )[0]
    return policy.transformer(
        hidden_states=x,
        timestep=t.expand(1),
        encoder_hidden_states=emb,
        pooled_projections=row[f"{prefix}pooled_prompt_embeds"][None],
        return_dict=False,
    )[0]


@pytest.mark.parametrize("name,key", [("qwen_image", "true_cfg_scale"), ("sd3", "guidance_scale")])
def test_cfg_gradient_flows_through_the_unconditional_branch(name, key):
    """As flow_grpo and verl-omni train it, the guided prediction's gradient includes the unconditional branch's:
    the LoRA gradient of the policy's guided velocity (both branches in one call, padded with a mask, combined in
    fp32) equals the one computed by hand from the two branches run alone and combined with the pipeline's formula
    (Qwen-Image: norm-preserving true CFG; SD3: standard CFG), and differs from the gradient with the unconditional
    branch detached."""
    scale = 4.0
    policy = make(name, **{key: scale})
    with torch.no_grad():  # a trained adapter: B != 0, so LoRA A has a gradient too
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompts = ["a red sign", "a much longer prompt about a blue shop sign"]
    cond = policy.encode(prompts)
    x = policy.adapter.init_latents(sample_generators([1, 2]))
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))  # the scalar (v * w).sum() is compared
    i, lora = 1, policy.trainable_parameters()
    t = policy.timesteps[i]

    def grad(v):
        return torch.cat([g.flatten() for g in torch.autograd.grad((v * w).sum(), lora)])

    def by_hand(detach_uncond: bool):
        out = []
        for j, row in enumerate(split_conditioning(cond, len(prompts))):
            pos = _branch(policy, name, x[j : j + 1], t, row)
            neg = _branch(policy, name, x[j : j + 1], t, row, "negative_")
            neg = neg.detach() if detach_uncond else neg
            comb = neg + scale * (pos - neg)
            if name == "qwen_image":
                comb = comb * pos.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True)
            out.append(comb)
        return torch.cat(out)

    got, want, detached = grad(policy.velocity(cond, x, i)), grad(by_hand(False)), grad(by_hand(True))
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-6 * want.abs().max()), (got - want).abs().max()
    assert (want - detached).norm() > 0.05 * want.norm()  # the unconditional branch's share is not negligible


def test_window_noise_is_each_samples_own_draws_in_step_order():
    """Pre-drawn SDE noise = what drawing at each window step gave: sample i's generator, step after step."""
    like = torch.zeros(2, 3, 4)
    noise = window_noise(sample_generators([5, 6]), like, 3)
    for i, seed in enumerate([5, 6]):
        g = torch.Generator().manual_seed(seed)
        assert torch.equal(noise[i], torch.stack([torch.randn(3, 4, generator=g) for _ in range(3)]))
    assert window_noise(sample_generators([5]), like[:1], 0).shape == (1, 0, 3, 4)


class HostReads(TorchFunctionMode):
    """Records, in order, every read of a tensor into Python or onto the host (on CUDA each waits for the device)
    and every ``backward``."""

    READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu", "nonzero"}

    def __init__(self):
        super().__init__()
        self.log: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS or name == "backward":
            self.log.append(name)
        return func(*args, **(kwargs or {}))


def test_no_host_read_per_denoising_step_nor_before_the_updates_last_backward():
    """The hot loops do not wait for the device: the rollout reads as often with 8 steps as with 4 (no
    ``float(sigmas[1])`` per step, noise copied once), and the update reads its metrics once, after the last
    ``backward`` of the window, however long the window (no ``.item()`` per metric per step)."""
    policy = make("qwen_image", true_cfg_scale=4.0)
    prompts, seeds = ["a red sign", "a much longer blue sign"], [1, 2]
    counts = []
    for steps in (4, 8):
        with HostReads() as reads:
            policy.with_sampling(num_inference_steps=steps).rollout(prompts, seeds, range(1, 3))
        counts.append(len(reads.log))
    assert counts[0] == counts[1], counts

    modality, actor_cfg = (
        ImageModality(),
        OmegaConf.create({"diffusion_loss": {"clip_ratio": 0.2}, "kl_loss_coef": 0.01}),
    )
    logs = []
    for window in (range(1, 2), range(0, 3)):
        results = policy.generate(prompts, seeds, window)
        samples = [
            Sample(i, f"g{i}", PromptRow(p, "t", ""), s, result=r, outcome=RewardOutcome("ok", 0.0))
            for i, (p, s, r) in enumerate(zip(prompts, seeds, results, strict=True))
        ]
        batch = DataProto.from_dict(
            tensors={**modality.batch_tensors(samples), "advantages": torch.tensor([1.0, -1.0])},
            meta_info={"window_start": window.start},
        )
        with HostReads() as reads:
            metrics = modality.backward(policy, batch, torch.ones(2, dtype=torch.bool), actor_cfg)
        assert reads.log.count("backward") == len(window) and len(metrics["actor/ratio_mean"]) == len(window)
        logs.append(reads.log)
    for log in logs:  # between the first and the last backward nothing is read; after it, one read
        first, last = log.index("backward"), len(log) - 1 - log[::-1].index("backward")
        assert set(log[first : last + 1]) == {"backward"} and log[last + 1 :] == ["tolist"], log
    before = [log[: log.index("backward")] for log in logs]
    assert len(before[0]) == len(before[1]), before  # reading the batch's masks: per batch, not per step


def test_lora_weights_roundtrip_and_reference_is_adapter_off():
    policy, other = make("sd3"), make("sd3")
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    state = policy.weights_state_dict()
    assert state and all("lora" in k for k in state)
    other.load_weights_state_dict(state)
    a = policy.rollout(["z"], [5], range(0, 1))
    b = other.rollout(["z"], [5], range(0, 1))
    np.testing.assert_array_equal(a.images, b.images)
    cond = policy.encode(["z"])
    x = a.window_latents[:, 0]
    with policy.reference():
        ref = policy.step(cond, x, 0, prev_sample=a.window_latents[:, 1])
    base = make("sd3")  # freshly initialised LoRA (B = 0) == the base model
    want = base.step(base.encode(["z"]), x, 0, prev_sample=a.window_latents[:, 1])
    assert torch.allclose(ref.mean, want.mean, atol=1e-6)
    assert not torch.allclose(policy.step(cond, x, 0, prev_sample=a.window_latents[:, 1]).mean, want.mean, atol=1e-4)
    with pytest.raises(KeyError, match="do not match"):
        other.load_weights_state_dict({"transformer_blocks.0.attn.nope.lora_A.weight": torch.zeros(1)})


def test_wan_frames_round_to_the_temporal_compression_as_diffusers_and_verl_omni(caplog):
    # diffusers' WanPipeline and verl-omni's Wan 2.2 rollout: num_frames // 4 * 4 + 1 (its DanceGRPO recipe's 8 -> 9)
    policy = make("wan", num_frames=8)
    assert policy.sampling.num_frames == 9 and "generating 9 frames" in caplog.text
