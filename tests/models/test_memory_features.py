"""The diffusion policy's memory features (issue 13, item 4), on one tiny Qwen-Image policy:

* prompt encodings made once at rollout and carried to the update: the log-prob recompute and the loss never run the
  text encoder, give the rollout's log-probs, and the encodings never reach a reward chunk;
* VAE decode in slices (the same pixels) and, for video, in tiles.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto

from omni_async.modality.image import ImageModality
from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig
from omni_async.reward.worker import sample_to_proto
from omni_async.sample import PromptRow, RewardOutcome, Sample

# Byte-level tiny tokenizer: prompts of different lengths, so Qwen-Image pads a batch and needs its text mask.
PROMPTS = ["a red sign", "a very much longer prompt about a blue sign", "hi", "a sign that says 12"]


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return DiffusionPolicy("tiny:qwen_image", SamplingConfig(height=32, width=32, num_inference_steps=4,
                                                             true_cfg_scale=4.0),
                           lora_rank=4, lora_alpha=8, target_modules=["to_q", "to_v"])


def test_update_path_uses_the_carried_encodings_and_never_the_text_encoder(policy, monkeypatch, no_network):
    # Two rollout batches: each pads to its own longest prompt; the training batch mixes them.
    results = policy.generate(PROMPTS[:2], [1, 2], range(1, 3)) + policy.generate(PROMPTS[2:], [3, 4], range(1, 3))
    samples = [Sample(i, f"u{i // 2}", PromptRow(p, "x", ""), i, result=r, outcome=RewardOutcome("ok", 1.0))
               for i, (p, r) in enumerate(zip(PROMPTS, results, strict=True))]

    one = results[0].conditioning
    assert set(one) == {"prompt_embeds", "negative_prompt_embeds"}  # CFG > 1: the negative prompt's too
    lengths = [r.conditioning["prompt_embeds"].shape[0] for r in results]
    assert len(set(lengths)) == 4  # each sample keeps only its own tokens (no padding of its rollout batch)
    t = one["prompt_embeds"]  # its own storage: pickling one sample does not ship its batch
    assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    assert not {"prompt_embeds", "negative_prompt_embeds"} & set(sample_to_proto(samples[0].reward_input()).batch.keys())

    modality = ImageModality()
    tensors = modality.batch_tensors(samples)
    assert tensors["prompt_embeds"].shape[:2] == (4, max(lengths))
    assert tensors["prompt_embeds_mask"].sum(1).tolist() == lengths
    batch = DataProto.from_dict(tensors={**tensors, "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]),
                                         "loss_mask": torch.ones(4, dtype=torch.bool)},
                                non_tensors={"prompt": np.array(PROMPTS, dtype=object)}, meta_info={"window_start": 1})

    def text_encoder_called(*args, **kwargs):
        raise AssertionError("the text encoder ran in the update path")

    monkeypatch.setattr(policy.pipe, "encode_prompt", text_encoder_called)
    monkeypatch.setattr(policy.pipe.text_encoder, "forward", text_encoder_called)
    with torch.no_grad():
        again = modality.log_probs(policy, batch)
    rollout = torch.stack([r.log_probs for r in results])
    # Same weights: the recompute under the mini-batch's padding equals the rollout's under its own.
    assert (again - rollout).abs().max() < 1e-5, (again - rollout).abs().max()
    metrics = modality.backward(policy, batch, torch.ones(4, dtype=torch.bool),
                                OmegaConf.create({"clip_ratio": 0.2, "kl_loss_coef": 0.01}))
    assert metrics["actor/ratio_mean"] == pytest.approx([1.0, 1.0], abs=1e-5)
    assert all(p.grad is not None for p in policy.trainable_parameters())
    policy.trainable.zero_grad(set_to_none=True)


def test_vae_decodes_in_slices_with_the_same_pixels_and_tiles_video(policy, monkeypatch):
    vae = policy.pipe.vae
    assert vae.use_slicing and not vae.use_tiling  # defaults for images: vae_slicing=true, vae_tiling=null
    latents = policy.adapter.init_latents([torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    calls = []
    one_at_a_time = vae._decode
    monkeypatch.setattr(vae, "_decode", lambda z, **kw: calls.append(z.shape[0]) or one_at_a_time(z, **kw))
    with torch.no_grad():
        sliced = policy.adapter.decode(latents)
        assert calls == [1, 1, 1]  # one sample per VAE forward
        vae.disable_slicing()
        whole = policy.adapter.decode(latents)
    assert calls[3:] == [3] and (sliced - whole).abs().max() < 1e-5

    monkeypatch.setattr(policy.sampling, "num_frames", 5)  # video: tiled decode by default (vae_tiling=null)
    policy.configure_vae()
    assert vae.use_slicing and vae.use_tiling
    monkeypatch.setattr(policy.sampling, "vae_tiling", False)  # an explicit value wins
    policy.configure_vae()
    assert not vae.use_tiling
    monkeypatch.undo()
    policy.configure_vae()
