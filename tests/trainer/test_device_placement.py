"""Every modality's worker path with the model on another device than the driver's tensors (``fake_device``: a
pretend accelerator with CUDA's placement rules), so a CPU tensor meeting a device tensor fails here as on a GPU.

The path is the worker's own code, without Ray: the policy's ``generate`` (what a rollout worker's batcher calls),
the driver's ``batch_tensors`` (CPU), the log-prob recompute and one optimizer step of ``trainer.actor_core`` (the
modality's backward with the KL reference, gradient clip, AdamW; ``optimizer_offload``, and ``param_offload`` for
the diffusion models), the recompute again, and (Qwen-Image) the next generate, whose frozen modules come back from
the offload. About 2 s per model here; the same path on the CPU alone takes about a quarter of that.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from fake_device import NAME, FakeDevice, on_device

from omni_async.modality import REF_TIME_KEY, get_modality
from omni_async.sample import ImageResult, PromptRow, RewardOutcome, Sample
from omni_async.trainer.actor_core import TensorBatch, compute_log_prob, train_minibatch

IMAGE = dict(height=32, width=32, num_inference_steps=2)
IMAGE_TARGETS = ["to_q", "to_v"]
CASES = {  # modality, model path, sampling, LoRA targets; CFG on, so the negative prompt's tensors travel too
    "qwen_image": ("image", "tiny:qwen_image", {**IMAGE, "true_cfg_scale": 2.0}, IMAGE_TARGETS),
    "sd3": ("image", "tiny:sd3", {**IMAGE, "guidance_scale": 2.0}, IMAGE_TARGETS),
    "wan": ("image", "tiny:wan", {**IMAGE, "num_frames": 5, "guidance_scale": 2.0}, IMAGE_TARGETS),
    "qwen2": ("text", "tiny:qwen2", {"response_length": 6, "temperature": 1.0}, ["q_proj", "v_proj"]),
}
REGENERATE = {"qwen_image"}  # generate again after the update (one family is enough for the offload's way back)
PROMPTS = ["a red sign", "a big blue sign that says 12"]  # different lengths: padded text with a mask
SEEDS = [11, 12]
WINDOW = range(1, 2)


def result_tensors(result) -> list[torch.Tensor]:
    if isinstance(result, ImageResult):
        return [result.window_latents, result.log_probs, *result.conditioning.values()]
    return [result.log_probs]


@pytest.mark.parametrize("name", list(CASES))
def test_generate_update_recompute_with_the_model_on_another_device(name):
    kind, path, sampling, targets = CASES[name]
    modality = get_modality(kind)
    image = kind == "image"
    window = (WINDOW,) if image else ()
    torch.manual_seed(0)
    with FakeDevice() as device:
        policy = modality.build_policy(
            {"path": path, "lora_rank": 4, "lora_alpha": 8, "target_modules": targets}, sampling, device=NAME
        )
        results = policy.generate(PROMPTS, SEEDS, *window)
        # What goes back through Ray to the driver is on the CPU.
        assert not any(on_device(t) for r in results for t in result_tensors(r))
        if not image:  # per-sample generators on the device: a sample does not depend on its batch
            alone = policy.generate(PROMPTS[1:], SEEDS[1:])[0]
            assert alone.response_ids == results[1].response_ids

        samples = [
            Sample(i, f"u{i}", PromptRow(p, "test", ""), s, result=r, outcome=RewardOutcome("ok", float(i)))
            for i, (p, s, r) in enumerate(zip(PROMPTS, SEEDS, results, strict=True))
        ]
        tensors = modality.batch_tensors(samples)  # the driver's batch: CPU tensors
        batch = TensorBatch(
            {**tensors, "advantages": torch.tensor([1.0, -1.0]), "loss_mask": torch.ones(2, dtype=torch.bool)},
            {"window_start": WINDOW.start} if image else {},
        )

        old = compute_log_prob(modality, policy, batch)
        assert not on_device(old)
        valid = tensors["response_mask"].bool() if not image else torch.ones_like(old, dtype=torch.bool)
        assert (old - tensors["old_log_probs"])[valid].abs().max() < 1e-4  # the rollout's log-probs, recomputed

        cfg = SimpleNamespace(
            clip_ratio=0.2,  # text (verl's key); images read diffusion_loss.clip_ratio
            diffusion_loss=SimpleNamespace(clip_ratio=0.2),
            kl_loss_coef=0.01,
            grad_clip=1.0,
            ppo_micro_batch_size_per_gpu=2,
        )
        optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=0.05)
        synced = device.synchronized
        metrics = train_minibatch(modality, policy, optimizer, batch, cfg, param_offload=image, optimizer_offload=True)
        # The reference forward's timer waited for the device at its start and end.
        assert device.synchronized - synced >= 2 and metrics[REF_TIME_KEY]
        assert metrics["actor/skipped_steps"] == [0.0] and metrics["actor/grad_norm"][0] > 0
        assert all(isinstance(v, float) and math.isfinite(v) for vs in metrics.values() for v in vs)

        new = compute_log_prob(modality, policy, batch)
        assert not on_device(new) and (new - old)[valid].abs().max() > 1e-4  # the update changed the policy
        if name in REGENERATE:  # after the offload: the text encoder and VAE come back to the device
            again = policy.generate(PROMPTS[:1], SEEDS[:1], *window)
            assert not any(on_device(t) for t in result_tensors(again[0]))
