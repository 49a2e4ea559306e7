"""Ulysses sequence parallelism (``models.sequence_parallel``). On two real gloo ranks (spawned processes): one group
of ``sp=2`` ranks given the same 2 samples of tiny Qwen-Image (LoRA, gradient checkpointing, one sample per
micro-batch) recomputes the one-process log-probs and accumulates, after the data-parallel all-reduce, the one-process
loss and LoRA gradients to float rounding (fp32), each rank's blocks seeing half of the tokens; the two ranks generate
one batch together (each sample its own SDE window, each rank's blocks on half of every sequence) and both get the
one-process samples: window latents, log-probs, images. The trainer-level run (a group of two Ray actor ranks
generating and training one-step off-policy) is ``test_sequence_parallel_rollout.py``.

In process: text padded to a multiple of the ranks (masked) leaves the image output as it was; a transformer diffusers
gives no context-parallel plan (SD3), heads that do not divide, or an attention backend without a context-parallel path
is refused by name. The dispatch / collect of a
group's share by data-parallel rank is ``test_data_parallel.py``'s."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from spawned_ranks import free_port, run_ranks

SP = 2
# the two prompts' token counts differ in parity, so one of them is padded to a multiple of SP
PROMPTS, SEEDS = ["a red sign!", "draw a blue door"], [1, 2]
ACTOR_CFG = {"diffusion_loss": {"clip_ratio": 0.2}, "kl_loss_coef": 0.0, "ppo_micro_batch_size_per_gpu": 1}
WINDOW = range(1, 3)  # two SDE steps of four
GEN_WINDOWS = [WINDOW, range(0, 2)]  # a generation batch: each sample its own SDE window


def tiny_transformer():
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    return QwenImageTransformer2DModel(
        num_layers=1,
        num_attention_heads=2,
        attention_head_dim=16,
        patch_size=2,
        in_channels=64,
        out_channels=16,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    )


def test_text_padded_to_a_multiple_of_the_ranks_leaves_the_image_output_unchanged():
    from omni_async.models.sequence_parallel import pad_text

    model, g = tiny_transformer(), torch.Generator().manual_seed(1)
    call = {
        "hidden_states": torch.randn(2, 4, 64, generator=g),
        "encoder_hidden_states": torch.randn(2, 5, 32, generator=g),
        "encoder_hidden_states_mask": None,
        "timestep": torch.tensor([0.3, 0.8]),
        "img_shapes": [[(1, 2, 2)]] * 2,
    }
    with torch.no_grad():
        whole = model(**call, return_dict=False)[0]
        for mask in (None, torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])):  # no mask; one sample's own padding
            given = {**call, "encoder_hidden_states_mask": mask}
            padded = pad_text(given, 4, "QwenImageTransformer2DModel")
            assert padded["encoder_hidden_states"].shape[1] == 8 and padded["encoder_hidden_states_mask"].shape == (
                2,
                8,
            )
            expected = whole if mask is None else model(**given, return_dict=False)[0]
            assert torch.allclose(model(**padded, return_dict=False)[0], expected, atol=1e-6)
    even = {**call, "encoder_hidden_states": call["encoder_hidden_states"][:, :4]}
    assert pad_text(even, 2, "m") is even  # 4 image and 4 text tokens divide by 2: as given
    with pytest.raises(ValueError, match="4 image tokens.*height / width"):
        pad_text(call, 3, "m")
    no_mask = {k: v for k, v in call.items() if k != "encoder_hidden_states_mask"}
    with pytest.raises(ValueError, match="takes no text mask.*max_sequence_length"):
        pad_text(no_mask, 2, "FluxTransformer2DModel")


def test_a_transformer_without_a_context_parallel_plan_or_with_indivisible_heads_is_refused_by_name():
    from diffusers import SD3Transformer2DModel

    from omni_async.models.sequence_parallel import check_supported

    sd3 = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        pooled_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=8,
    )
    with pytest.raises(ValueError, match="SD3Transformer2DModel declares no context-parallel plan"):
        check_supported(sd3, 2)
    with pytest.raises(ValueError, match="2 attention heads.*divisor of 2"):
        check_supported(tiny_transformer(), 4)
    check_supported(tiny_transformer(), 2)  # native: torch SDPA
    math = tiny_transformer()
    math.set_attention_backend("_native_math")  # diffusers would pass it the parallel config and ignore it
    with pytest.raises(ValueError, match="attention backend '_native_math' has no context-parallel path"):
        check_supported(math, 2)


def tiny_lora_policy():
    from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig

    torch.manual_seed(0)  # the same LoRA initialisation in every process
    policy = DiffusionPolicy(
        "tiny:qwen_image",
        SamplingConfig(height=32, width=32, num_inference_steps=4),
        lora_rank=4,
        dtype=torch.float32,
        gradient_checkpointing=True,  # as on CUDA by default: each block's forward (and its all-to-alls) runs again
    )
    with torch.no_grad():  # LoRA's B starts at 0: move it, so every LoRA weight has a gradient
        for p in policy.trainable_parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    policy.refresh_working_weights()
    return policy


def tiny_video_policy():
    """tiny Wan 2.1 (video: 5 frames, CFG), the same weights in every process."""
    from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig

    torch.manual_seed(0)
    sampling = SamplingConfig(height=32, width=32, num_inference_steps=4, num_frames=5, guidance_scale=2.0)
    return DiffusionPolicy("tiny:wan", sampling, lora_rank=4, dtype=torch.float32)


def generated(out) -> dict[str, torch.Tensor]:
    return {"log_probs": out.log_probs, "window_latents": out.window_latents, "images": torch.as_tensor(out.images)}


def generate_video(policy, sp=None) -> dict:
    """Its samples and the video tokens a block got per call (all of them, or this rank's share)."""
    seen: list[int] = []
    # the second block: the split happens at the first one's input (inside its forward, after a pre-hook)
    hook = policy.transformer.blocks[1].register_forward_pre_hook(lambda m, args: seen.append(int(args[0].shape[1])))
    with sp.active() if sp is not None else contextlib.nullcontext():
        out = generated(policy.rollout(PROMPTS, SEEDS, window=GEN_WINDOWS))
    hook.remove()
    return {**out, "tokens": sorted(set(seen))}


def batch_of(tensors: dict):
    from omni_async.trainer.actor_core import TensorBatch

    return TensorBatch(dict(tensors), {"window_start": WINDOW.start})


def gradients(policy) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in policy.trainable.named_parameters() if p.requires_grad}


def token_counts(policy) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    """The image and text tokens the second block gets, per call (after the first block's split, when active)."""
    seen: list[int] = []

    def hook(module, args, kwargs):  # checkpointing passes the block's inputs by position
        image, text = args[:2] if args else (kwargs["hidden_states"], kwargs["encoder_hidden_states"])
        seen.append(int(image.shape[1]) + int(text.shape[1]))

    return seen, policy.transformer.transformer_blocks[1].register_forward_pre_hook(hook, with_kwargs=True)


def rank_main(rank: int, results: dict, port: int, batch_path: str) -> None:
    from omegaconf import OmegaConf

    from omni_async.modality.image import ImageModality
    from omni_async.models.sequence_parallel import SequenceParallel, denoisers
    from omni_async.trainer.actor_core import accumulate_gradients, compute_log_prob
    from omni_async.trainer.data_parallel import DataParallel

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(SP), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dp = DataParallel("cpu", timeout_s=120.0, sp=SP)
    policy = tiny_lora_policy()
    sp = SequenceParallel(denoisers(policy), SP, dp.rank, dp.world, dp.device)
    data, modality = batch_of(torch.load(batch_path)), ImageModality()
    seen, handle = token_counts(policy)
    with sp.active():
        results["log_probs"] = compute_log_prob(modality, policy, data)
        metrics = accumulate_gradients(modality, policy, data, OmegaConf.create(ACTOR_CFG), dp)
    results["tokens"] = sorted(set(seen))
    dp.all_reduce_grads(policy.trainable_parameters())
    results["loss"], results["grads"] = metrics["actor/pg_loss"], gradients(policy)
    seen.clear()
    with sp.active():  # both ranks generate the same batch together, each on half of every sequence
        out = policy.rollout(PROMPTS, SEEDS, window=GEN_WINDOWS)
    results["generated"] = generated(out)
    results["tokens_generating"] = sorted(set(seen))
    handle.remove()
    video = tiny_video_policy()
    results["video"] = generate_video(video, SequenceParallel(denoisers(video), SP, dp.rank, dp.world, dp.device))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The one-process reference (log-probs, loss, gradients, token counts), then the two ranks' results."""
    from omegaconf import OmegaConf

    from omni_async.modality.image import ImageModality
    from omni_async.trainer.actor_core import accumulate_gradients, compute_log_prob

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: a CPU reduction's order depends on the thread count
    try:
        policy = tiny_lora_policy()
        seen, handle = token_counts(policy)
        images = generated(policy.rollout(PROMPTS, SEEDS, window=GEN_WINDOWS))
        tokens_generating = sorted(set(seen))
        video = generate_video(tiny_video_policy())
        out = policy.rollout(PROMPTS, SEEDS, window=WINDOW)
        tensors = {
            "window_latents": out.window_latents,
            "old_log_probs": out.log_probs,
            "advantages": torch.tensor([1.0, -0.5]),
            "loss_mask": torch.ones(2, dtype=torch.bool),
            **out.conditioning,
        }
        path = tmp_path_factory.mktemp("sp") / "batch.pt"
        torch.save(tensors, path)
        data = batch_of(tensors)
        seen.clear()
        metrics = accumulate_gradients(ImageModality(), policy, data, OmegaConf.create(ACTOR_CFG))
        reference = {
            "log_probs": compute_log_prob(ImageModality(), policy, data),
            "loss": metrics["actor/pg_loss"],
            "grads": gradients(policy),
            "tokens": sorted(set(seen)),
            "tokens_generating": tokens_generating,
            "generated": images,
            "video": video,
        }
        handle.remove()
    finally:
        torch.set_num_threads(threads)

    results = run_ranks(rank_main, SP, free_port(), str(path), out_dir=path.parent, timeout_s=300)
    return reference, results


@pytest.mark.slow  # two spawned ranks: not in the fast tier (pytest -m 'not slow')
def test_two_sequence_ranks_give_one_process_log_probs_loss_and_gradients(ranks):
    reference, results = ranks
    for res in results.values():
        assert torch.allclose(res["log_probs"], reference["log_probs"], atol=1e-5)
        assert res["loss"] == pytest.approx(reference["loss"], rel=1e-5, abs=1e-7)
        assert res["grads"].keys() == reference["grads"].keys()
        for name, g in reference["grads"].items():
            assert g.abs().max() > 0, name  # every LoRA weight is trained (the check below is not vacuous)
            assert torch.allclose(res["grads"][name], g, rtol=1e-4, atol=1e-6), name


@pytest.mark.slow
def test_each_rank_holds_half_of_every_sequence_when_training_and_generating(ranks):
    reference, results = ranks
    for key in ("tokens", "tokens_generating"):
        padded = sorted({t + t % SP for t in reference[key]})  # an odd text count padded to a multiple of SP
        for res in results.values():
            assert res[key] == [t // SP for t in padded], key


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["generated", "video"])
def test_two_sequence_ranks_generate_one_process_samples(ranks, kind):
    """Both ranks of the group generate the same batch together: each gets the one-process samples (the SDE
    window's latents and log-probs, the decoded images; Qwen-Image, and Wan 2.1's 5-frame video with CFG) to float
    rounding."""
    reference, results = ranks
    for res in results.values():
        if kind == "video":  # each rank's blocks got half of every video's tokens
            assert res["video"]["tokens"] == [t // SP for t in reference["video"]["tokens"]]
        for name, want in reference[kind].items():
            if name == "tokens":
                continue
            got = res[kind][name]
            assert got.shape == want.shape and got.dtype == want.dtype, name
            # float tensors to rounding; 8-bit pixels to one level (a rounding can cross a level's edge)
            tol = 1.0 if want.dtype == torch.uint8 else 1e-5
            assert (got.double() - want.double()).abs().max() <= tol, name
