"""Bytes per sample on the rollout -> reward -> trainer path, FlowGRPO against DiffusionNFT (issue 38).

Three hops, each measured as the pickled bytes Ray moves for one sample:

- ``rollout_to_driver``: the rollout worker's answer, the ``ImageResult`` (pixels, the SDE window's latents and
  log-probs for FlowGRPO or the clean final latents for DiffusionNFT, the prompt encodings);
- ``driver_to_reward``: the one-row reward chunk (``reward.worker.sample_to_proto``: pixels and text; the same for
  both losses);
- ``driver_to_trainer``: the sample's share of the actor's batch (``ImageModality.batch_tensors`` plus what
  ``StepOps.build_batch`` adds), a ``DataProto`` pickled and divided by its rows.

Measured on tiny models (``--models``) by generating real samples on the CPU, and for the real Qwen-Image at 512²
and 1024² from the tensor shapes the same code makes (no weights needed): packed latents ``[(H/16)(W/16), 64]``
fp32, prompt encodings ``[S, 3584]`` in bf16 (the GPU's compute dtype), a window of ``sde_window_size`` steps.

    python bench/nft_payload.py --out bench/results/nft_payload.json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
from pathlib import Path

import numpy as np
import torch


def pickled(obj) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def measure_tiny(model: str, size: int, steps: int, window: int, n: int = 4) -> dict:
    """Real samples of a tiny model through the real record, batch and reward-chunk code."""
    from verl import DataProto

    from omni_async.agent_loop.draws import SEED_NFT_NOISE, sample_seed
    from omni_async.algos.diffusion_nft import optimality_probability, train_steps
    from omni_async.modality.image import ImageModality
    from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig
    from omni_async.reward.worker import sample_to_proto
    from omni_async.sample import PromptRow, RewardOutcome, Sample

    out = {}
    prompts, seeds = [f"a sign that says {i}" for i in range(n)], list(range(n))
    for loss in ("flow_grpo", "diffusion_nft"):
        nft = loss == "diffusion_nft"
        torch.manual_seed(0)
        sampling = SamplingConfig(height=size, width=size, num_inference_steps=steps, clean_latents=nft)
        policy = DiffusionPolicy(model, sampling, lora_rank=8, target_modules=["to_q", "to_k", "to_v"])
        results = policy.generate(prompts, seeds, None if nft else [range(1, 1 + window)] * n)
        samples = [
            Sample(i, f"u{i // 2}", PromptRow(p, "ocr", "x"), s, result=r, outcome=RewardOutcome("ok", 0.1 * i))
            for i, (p, s, r) in enumerate(zip(prompts, seeds, results, strict=True))
        ]
        tensors = ImageModality(loss).batch_tensors(samples)
        adv = torch.linspace(-1, 1, n)
        tensors["advantages"], tensors["loss_mask"] = adv, torch.ones(n, dtype=torch.bool)
        if nft:  # what StepOps.build_batch adds
            tensors["reward_prob"] = optimality_probability(adv, adv_clip_max=5.0).unsqueeze(-1)
            g = torch.Generator().manual_seed(0)
            tensors["train_steps"] = torch.stack([train_steps(steps, 1.0, g) for _ in range(n)])
            tensors["noise_seed"] = torch.tensor([sample_seed(s, 0, 0, SEED_NFT_NOISE) for s in seeds])
        else:
            tensors["window_start"] = torch.ones(n, dtype=torch.long)
        batch = DataProto.from_dict(tensors=tensors, non_tensors={"uid": np.array([s.uid for s in samples])})
        out[loss] = {
            "rollout_to_driver": int(np.mean([pickled(r) for r in results])),
            "driver_to_reward": int(np.mean([pickled(sample_to_proto(s.reward_input())) for s in samples])),
            "driver_to_trainer": pickled(batch) // n,
        }
    return out


def estimate_qwen_image(size: int, window: int, prompt_tokens: int = 256, hidden: int = 3584) -> dict:
    """The real Qwen-Image's per-sample tensors at ``size``² from their shapes (fp32 latents, bf16 encodings of
    ``prompt_tokens`` tokens: the upper bound at the recipes' max_sequence_length=256; a sample carries its valid
    tokens only)."""
    latent = (size // 16) ** 2 * 64 * 4  # packed 2x2 latent tokens x 64 channels, fp32
    cond = prompt_tokens * hidden * 2 + prompt_tokens * 8  # bf16 embeddings + int64 mask
    pixels = size * size * 3
    window_part = (window + 1) * latent + window * 4  # window latents + fp32 log-probs
    return {
        "flow_grpo": {
            "rollout_to_driver": pixels + window_part + cond,
            "driver_to_reward": pixels,
            "driver_to_trainer": window_part + cond + 8 + 4 + 4 + 1,
        },  # fmt: skip
        "diffusion_nft": {
            "rollout_to_driver": pixels + latent + cond,
            "driver_to_reward": pixels,
            "driver_to_trainer": latent + cond + 4 + 4 + 8 * 10 + 8 + 4 + 1,
        },  # fmt: skip
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny:qwen_image,tiny:sd3")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--window", type=int, default=2, help="FlowGRPO's sde_window_size (the default config's)")
    p.add_argument("--out", default="bench/results/nft_payload.json")
    a = p.parse_args()
    torch.set_num_threads(1)
    report = {
        "what": "pickled bytes per sample per hop, FlowGRPO vs DiffusionNFT (bench/nft_payload.py)",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, CPU only",
        "tiny_measured": {
            m: measure_tiny(m, a.size, a.steps, a.window) | {"size": a.size} for m in a.models.split(",")
        },
        "qwen_image_estimated": {f"{s}x{s}": estimate_qwen_image(s, a.window) for s in (512, 1024)},
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
