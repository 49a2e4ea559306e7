"""The diffusion policy's memory features (issue 13, item 4), on one tiny Qwen-Image policy:

* prompt encodings made once at rollout and carried to the update: the log-prob recompute and the loss never run the
  text encoder, give the rollout's log-probs, and the encodings never reach a reward chunk;
* VAE decode in slices (the same pixels) and, for video, in tiles;
* ``param_offload`` / ``optimizer_offload`` through the actor's Ray-free core. On CPU the offload device is the
  compute device, so memory does not change: the tests check that the moves happen at the right times (spies) and
  that the update's result is unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto

from omni_async.modality.image import ImageModality
from omni_async.models import offload
from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig
from omni_async.reward.worker import sample_to_proto
from omni_async.sample import PromptRow, RewardOutcome, Sample
from omni_async.trainer.actor_core import TensorBatch, begin_step, update_minibatch

# Byte-level tiny tokenizer: prompts of different lengths, so Qwen-Image pads a batch and needs its text mask.
PROMPTS = ["a red sign", "a very much longer prompt about a blue sign", "hi", "a sign that says 12"]


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return DiffusionPolicy(
        "tiny:qwen_image",
        SamplingConfig(height=32, width=32, num_inference_steps=4, true_cfg_scale=4.0),
        lora_rank=4,
        lora_alpha=8,
        target_modules=["to_q", "to_v"],
    )


@pytest.fixture(scope="module")
def samples(policy):
    # Two rollout batches: each pads to its own longest prompt; the training batch mixes them.
    results = policy.generate(PROMPTS[:2], [1, 2], range(1, 3)) + policy.generate(PROMPTS[2:], [3, 4], range(1, 3))
    return [
        Sample(i, f"u{i // 2}", PromptRow(p, "x", ""), i, result=r, outcome=RewardOutcome("ok", 1.0))
        for i, (p, r) in enumerate(zip(PROMPTS, results, strict=True))
    ]


def test_update_path_uses_the_carried_encodings_and_never_the_text_encoder(policy, samples, monkeypatch, no_network):
    results = [s.result for s in samples]

    one = results[0].conditioning
    assert set(one) == {"prompt_embeds", "negative_prompt_embeds"}  # CFG > 1: the negative prompt's too
    lengths = [r.conditioning["prompt_embeds"].shape[0] for r in results]
    assert len(set(lengths)) == 4  # each sample keeps only its own tokens (no padding of its rollout batch)
    t = one["prompt_embeds"]  # its own storage: pickling one sample does not ship its batch
    assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    assert not {"prompt_embeds", "negative_prompt_embeds"} & set(
        sample_to_proto(samples[0].reward_input()).batch.keys()
    )

    modality = ImageModality()
    tensors = modality.batch_tensors(samples)
    assert tensors["prompt_embeds"].shape[:2] == (4, max(lengths))
    assert tensors["prompt_embeds_mask"].sum(1).tolist() == lengths
    batch = DataProto.from_dict(
        tensors={
            **tensors,
            "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]),
            "loss_mask": torch.ones(4, dtype=torch.bool),
        },
        non_tensors={"prompt": np.array(PROMPTS, dtype=object)},
        meta_info={"window_start": 1},
    )

    def text_encoder_called(*args, **kwargs):
        raise AssertionError("the text encoder ran in the update path")

    monkeypatch.setattr(policy.pipe, "encode_prompt", text_encoder_called)
    monkeypatch.setattr(policy.pipe.text_encoder, "forward", text_encoder_called)
    with torch.no_grad():
        again = modality.log_probs(policy, batch)
    rollout = torch.stack([r.log_probs for r in results])
    # Same weights: the recompute under the mini-batch's padding equals the rollout's under its own.
    assert (again - rollout).abs().max() < 1e-5, (again - rollout).abs().max()
    metrics = modality.backward(
        policy,
        batch,
        torch.ones(4, dtype=torch.bool),
        OmegaConf.create({"diffusion_loss": {"clip_ratio": 0.2}, "kl_loss_coef": 0.01}),
    )
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


def test_param_and_optimizer_offload_move_at_the_right_times_and_change_nothing(policy, samples, monkeypatch):
    modality = ImageModality()
    batch = TensorBatch(
        {
            **modality.batch_tensors(samples[:2]),
            "advantages": torch.tensor([1.0, -1.0]),
            "loss_mask": torch.tensor([True, True]),
        },
        {"window_start": 1},
    )
    cfg = OmegaConf.create(
        {
            "diffusion_loss": {"clip_ratio": 0.2},
            "kl_loss_coef": 0.0,
            "grad_clip": 1.0,
            "ppo_micro_batch_size_per_gpu": None,
        }
    )
    start = policy.weights_state_dict()

    def two_updates(**offloads):
        policy.load_weights_state_dict(start)
        optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)
        for _ in range(2):
            update_minibatch(modality, policy, optimizer, batch, cfg, **offloads)
            if offloads:  # between steps the AdamW moments are on the CPU (on this box: where they were)
                moments = [v for st in optimizer.state.values() for k, v in st.items() if k != "step"]
                assert moments and all(v.device == offload.OFFLOAD_DEVICE for v in moments)
        return policy.weights_state_dict()

    plain = two_updates()
    moves, state_moves, offloaded_at_forward = [], [], []
    host, back, real_move = offload.HostOffload.to_host, offload.HostOffload.to_device, offload.move_optimizer_state
    monkeypatch.setattr(
        offload.HostOffload, "to_host", lambda self: moves.append((len(self.modules), "host")) or host(self)
    )
    monkeypatch.setattr(
        offload.HostOffload,
        "to_device",
        lambda self, dev: moves.append((len(self.modules), str(dev))) or back(self, dev),
    )
    monkeypatch.setattr(
        offload, "move_optimizer_state", lambda opt, dev: state_moves.append(dev) or real_move(opt, dev)
    )
    policy.begin_step()
    hook = policy.transformer.register_forward_pre_hook(lambda *_: offloaded_at_forward.append(policy.frozen_offloaded))
    try:
        offloaded = two_updates(param_offload=True, optimizer_offload=True)
        n_update_forwards = len(offloaded_at_forward)
        assert moves == [(2, "host")]  # the text encoder and the VAE, once for both updates
        assert {id(m) for m in policy.frozen_modules()} == {id(policy.pipe.text_encoder), id(policy.pipe.vae)}
        assert state_moves == [None, offload.OFFLOAD_DEVICE] * 2  # to the params' device for each step, then back
        policy.generate(PROMPTS[:1], [9], range(1, 2))  # generation brings them back first
    finally:
        hook.remove()
    assert all(offloaded_at_forward[:n_update_forwards]) and not any(offloaded_at_forward[n_update_forwards:])
    assert moves[1:] == [(2, str(policy.device))] and not policy.frozen_offloaded
    assert max((plain[k] - offloaded[k]).abs().max().item() for k in plain) < 1e-6
    assert max((plain[k] - start[k]).abs().max().item() for k in plain) > 1e-5  # the updates did something
    policy.load_weights_state_dict(start)


def test_param_offload_makes_one_round_trip_per_step_through_reused_host_buffers(policy, samples):
    """In overlap modes generation batches and updates interleave on the device: the frozen modules go to the host
    at the step's first update, come back for the next generation and then stay, so one round trip per step (not
    one per switch), and every offload writes into the same host buffers, allocated once."""
    modality = ImageModality()
    batch = TensorBatch(
        {
            **modality.batch_tensors(samples[:2]),
            "advantages": torch.tensor([1.0, -1.0]),
            "loss_mask": torch.tensor([True, True]),
        },
        {"window_start": 1},
    )
    cfg = OmegaConf.create(
        {
            "diffusion_loss": {"clip_ratio": 0.2},
            "kl_loss_coef": 0.0,
            "grad_clip": 1.0,
            "ppo_micro_batch_size_per_gpu": None,
        }
    )
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=0.0)  # lr 0: the shared policy stays as it is
    policy.offload_frozen(False)
    before = dict(policy.host_offload.moves) if policy.host_offload else {"to_host": 0, "to_device": 0}
    storage = []
    for _ in range(2):  # two steps
        begin_step(policy, param_offload=True)  # the worker's weight sync
        for k in range(3):  # update, generation batch, update, ...
            update_minibatch(modality, policy, optimizer, batch, cfg, param_offload=True)
            if k == 0:
                assert policy.frozen_offloaded
                storage.append([p.data_ptr() for m in policy.frozen_modules() for p in m.parameters()])
            else:
                assert not policy.frozen_offloaded  # the step's round trip is done: they stay for its updates
            policy.generate(PROMPTS[:1], [9], range(1, 2))
    moves = {k: v - before[k] for k, v in policy.host_offload.moves.items()}
    assert moves == {"to_host": 2, "to_device": 2}  # not 6 each
    assert storage[0] == storage[1]  # the second step's offload wrote into the first one's buffers
    assert policy.host_offload.buffers_allocated == len(policy.host_offload.host)  # each buffer made once


def test_host_buffers_are_pinned_only_for_a_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not offload.pinned_host_memory("cuda:0") and not offload.pinned_host_memory("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert offload.pinned_host_memory("cuda:0") and offload.pinned_host_memory(torch.device("cuda", 1))
    assert not offload.pinned_host_memory("cpu")

    pinned, real_empty = [], torch.empty  # the choice reaches the allocation (pinning itself needs CUDA)
    layer = torch.nn.Linear(3, 2)
    monkeypatch.setattr(offload, "pinned_host_memory", lambda device: True)
    monkeypatch.setattr(
        offload.torch, "empty", lambda *a, pin_memory=False, **kw: pinned.append(pin_memory) or real_empty(*a, **kw)
    )
    offload.HostOffload([layer]).to_host()
    assert pinned == [True, True]  # weight and bias
