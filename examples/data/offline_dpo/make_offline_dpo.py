"""Write the tiny offline Diffusion-DPO dataset beside this script: ``train.parquet`` / ``test.parquet`` in verl-omni's
``OfflineDPODataset`` columns (``verl_omni/utils/dataset/offline_dpo_dataset.py``; the rows its
``tests/special_e2e/create_dummy_offline_dpo_data.py`` makes for its SD3 smoke run), for ``tiny:sd3`` at 32x32 with
CFG (guidance 4, verl-omni's SD3 offline recipe): its text encoders' outputs of each prompt (and of the empty negative
prompt), its VAE's latents of two solid-colour images per prompt (the chosen one, score 1, written to ``images/``,
and the rejected one, score 0), the tensors as ``torch.save`` bytes, as verl-omni stores them. Deterministic.

    python examples/data/offline_dpo/make_offline_dpo.py [--model tiny:sd3 --size 32 --tokens 32 --num-train 4]

The tensors are the model's: train another model (or size) on pairs encoded by it.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

HERE = Path(__file__).resolve().parent
PROMPTS = [
    "A red circle on a white background",
    "A blue square on a black background",
    "A green triangle next to an orange rectangle",
    "A yellow star above a grey line",
    "A purple heart in a white frame",
    "An orange sun over a blue sea",
]
WIN, LOSE = (220, 40, 40), (40, 40, 220)  # chosen red, rejected blue
SYSTEM = "You are a helpful image generation assistant."


def to_bytes(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t.detach().cpu().contiguous(), buf)
    return buf.getvalue()


def image_latents(pipe, image: Image.Image, size: int) -> torch.Tensor:
    """The VAE's latents of ``image`` as SD3's pipeline scales them (``(z - shift) * scale``), its mean."""
    pixels = pipe.image_processor.preprocess([image], height=size, width=size).to(pipe.vae.dtype)
    with torch.no_grad():
        z = pipe.vae.encode(pixels).latent_dist.mode()
    cfg = pipe.vae.config
    return ((z - (cfg.shift_factor or 0.0)) * cfg.scaling_factor)[0].float()


def rows(policy, prompts: list[str], split: str, size: int) -> list[dict]:
    images = HERE / "images"
    images.mkdir(exist_ok=True)
    out = []
    for i, prompt in enumerate(prompts):
        cond = policy.encode([prompt])  # prompt_embeds [1, S, D], pooled [1, D], the negative prompt's with CFG
        paths = []
        for tag, colour in (("win", WIN), ("lose", LOSE)):
            path = images / f"{split}_{i:03d}_{tag}.png"
            Image.new("RGB", (size, size), colour).save(path)
            paths.append(path)
        seq = cond["prompt_embeds"].shape[1]
        neg_seq = cond["negative_prompt_embeds"].shape[1]
        out.append(
            {
                "uid": f"{split}-{i}",
                "data_source": "offline_dpo_tiny",
                "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
                "negative_prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": " "}],
                "img_win": str(paths[0].relative_to(HERE)),
                "img_lose": str(paths[1].relative_to(HERE)),
                "img_win_latents": to_bytes(image_latents(policy.pipe, Image.open(paths[0]), size)),
                "img_lose_latents": to_bytes(image_latents(policy.pipe, Image.open(paths[1]), size)),
                "prompt_embeds": to_bytes(cond["prompt_embeds"][0]),
                "prompt_embeds_mask": to_bytes(torch.ones(seq, dtype=torch.int32)),
                "pooled_prompt_embeds": to_bytes(cond["pooled_prompt_embeds"][0]),
                "negative_prompt_embeds": to_bytes(cond["negative_prompt_embeds"][0]),
                "negative_prompt_embeds_mask": to_bytes(torch.ones(neg_seq, dtype=torch.int32)),
                "negative_pooled_prompt_embeds": to_bytes(cond["negative_pooled_prompt_embeds"][0]),
                "win_score": 1.0,
                "lose_score": 0.0,
                "reward_model": {"style": "rule", "ground_truth": prompt},
                "extra_info": {"split": split, "index": i, "raw_prompt": prompt, "raw_negative_prompt": " "},
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny:sd3")
    ap.add_argument("--size", type=int, default=32, help="the images' height and width (rollout.pipeline.height)")
    ap.add_argument("--tokens", type=int, default=32, help="T5 tokens kept per prompt (small files; SD3's is 256)")
    ap.add_argument("--num-train", type=int, default=4)
    ap.add_argument("--num-test", type=int, default=2)
    args = ap.parse_args()
    from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig

    torch.manual_seed(0)
    sampling = SamplingConfig(height=args.size, width=args.size, guidance_scale=4.0, max_sequence_length=args.tokens)
    policy = DiffusionPolicy(args.model, sampling)
    n = args.num_train
    for split, prompts in (("train", PROMPTS[:n]), ("test", PROMPTS[n : n + args.num_test])):
        pq.write_table(pa.Table.from_pylist(rows(policy, prompts, split, args.size)), HERE / f"{split}.parquet")
        print(f"wrote {HERE / f'{split}.parquet'} ({len(prompts)} pairs)")


if __name__ == "__main__":
    main()
