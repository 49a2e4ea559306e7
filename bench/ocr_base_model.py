"""What a base renderer offers FlowGRPO's OCR reward, measured offline (no trainer, no Ray): one process, 1 thread.

For a tiny text renderer (``tiny:qwen_image_text_bimodal`` by default) and its prompt vocabulary:

- ``reward``: OCR reward of groups of ``--group`` samples per prompt, sampled as training samples them (SDE on a
  window of ``sde_window_size`` steps starting in ``sde_window_range``, noise 0.7) and as validation does (ODE), on
  training and held-out words: mean, histogram, the shares near 0 and near 1, the within-group std and the share of
  groups whose rewards are all equal (no gradient from those).
- ``window``: where the mode is decided. For a fixed initial noise, the SDE window's own noise is re-drawn
  ``--redraws`` times; the share of the reward variance that those re-draws explain, per window position. FlowGRPO's
  gradient only sees the window's transitions, so a window whose noise cannot change the reward gives a gradient
  of pure noise.
- ``snr``: the FlowGRPO policy gradient (ratio 1, group advantages as the trainer computes them) w.r.t. fresh LoRA
  weights (r8 on to_q, to_k, to_v, to_out.0, B = 0), over ``--batches`` batches of 4 prompts x ``--group``:
  SNR = (|mean g|^2 - tr(S)/K) / tr(S), tr(S) the per-batch gradient variance (unbiased), and the mean pairwise
  cosine of the batch gradients; the issue-17 measurement on ``tiny:qwen_image_text`` was 0.01-0.03.

    python bench/ocr_base_model.py --model tiny:qwen_image_text_bimodal --vocab tiny_text_bimodal --out FILE.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time
from pathlib import Path

import numpy as np
import torch

from omni_async.algos.advantages import group_advantages
from omni_async.algos.sde import sde_window
from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig, sample_generators
from omni_async.reward.scorers.ocr import compute_score

WEIGHTS = Path(__file__).resolve().parents[1] / "omni_async/models/weights"
VOCABS = {
    "tiny_text": WEIGHTS / "tiny_qwen_image_text/prompts.json",
    "tiny_text_bimodal": WEIGHTS / "tiny_qwen_image_text_bimodal/prompts.json",
}


def words_of(vocab: str) -> tuple[list[str], list[str], str]:
    meta = json.loads(VOCABS[vocab].read_text())
    held = set(meta["val"])
    train = ["".join(p) for k in meta["lengths"] for p in itertools.product(meta["alphabet"], repeat=k)]
    return [w for w in train if w not in held], sorted(held), meta["template"]


def ocr(images, words) -> np.ndarray:
    return np.array([compute_score("ocr", im, w)["score"] for im, w in zip(images, words, strict=True)])


def summary(scores: np.ndarray) -> dict:
    """``scores`` [prompts, group]."""
    flat = scores.ravel()
    return {
        "mean": round(float(flat.mean()), 3),
        "n": int(flat.size),
        "share_ge_0.9": round(float((flat >= 0.9).mean()), 3),
        "share_le_0.1": round(float((flat <= 0.1).mean()), 3),
        "histogram_5_bins_0_to_1": np.histogram(flat, bins=5, range=(0, 1))[0].tolist(),
        "within_group_std": round(float(scores.std(1).mean()), 3),
        "share_of_groups_all_equal": round(float((scores.std(1) == 0).mean()), 3),
    }


@torch.no_grad()
def sample(
    policy: DiffusionPolicy,
    prompts: list[str],
    init_seeds: list[int],
    window: range | None,
    window_seeds: list[int] | None = None,
) -> np.ndarray:
    """Images whose initial noise comes from ``init_seeds`` and whose window noise comes from ``window_seeds``
    (default: the same generators, as ``DiffusionPolicy.rollout`` draws them)."""
    gens = sample_generators(init_seeds)
    wgens = sample_generators(window_seeds) if window_seeds is not None else gens
    cond = policy.adapter.encode(prompts)
    x = policy.adapter.init_latents(gens)
    for i in range(policy.sampling.num_inference_steps):
        if window is not None and i in window:
            noise = torch.stack([torch.randn(x.shape[1:], generator=g) for g in wgens]).to(x)
            x = policy.step(cond, x, i, noise=noise).prev_sample
        else:
            x = policy.step(cond, x, i, noise=torch.zeros_like(x), noise_level=0.0).prev_sample
    img = policy.adapter.decode(x)
    return ((img.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).movedim(1, -1).numpy()


def measure_reward(policy, template, words: list[str], group: int, window_range, window_size, seed: int) -> dict:
    out = {}
    gen = torch.Generator().manual_seed(seed)
    steps = policy.sampling.num_inference_steps
    for mode in ("sde", "ode"):
        scores = np.zeros((len(words), group))
        for j in range(group):
            window = sde_window(steps, window_size, window_range, gen) if mode == "sde" else None
            seeds = [seed * 100_000 + i * group + j for i in range(len(words))]
            scores[:, j] = ocr(sample(policy, [template.format(text=w) for w in words], seeds, window), words)
        out[mode] = summary(scores)
    return out


def measure_window(
    policy, template, words: list[str], redraws: int, window_size: int, starts: list[int], seed: int
) -> dict:
    """Share of the reward variance explained by the window's noise, per window start (initial noise fixed)."""
    out = {}
    prompts = [template.format(text=w) for w in words]
    for s in starts:
        scores = np.stack(
            [
                ocr(
                    sample(
                        policy,
                        prompts,
                        [seed + i for i in range(len(words))],
                        range(s, s + window_size),
                        [seed * 7 + 10_000 * (r + 1) + i for i in range(len(words))],
                    ),
                    words,
                )
                for r in range(redraws)
            ],
            1,
        )  # [samples, redraws]
        within, total = scores.var(1).mean(), scores.var()
        out[f"steps {s}-{s + window_size - 1}"] = {
            "share": round(float(within / total), 3) if total > 0 else None,
            "flips": round(float((scores.std(1) > 0).mean()), 3),
            "mean": round(float(scores.mean()), 3),
        }
    return out


def measure_snr(
    policy, template, words: list[str], group: int, batches: int, window_range, window_size, seed: int
) -> dict:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    params = policy.trainable_parameters()
    grads, means = [], []
    steps = policy.sampling.num_inference_steps
    for k in range(batches):
        batch = rng.sample(words, 4)
        prompts = [template.format(text=w) for w in batch for _ in range(group)]
        truths = [w for w in batch for _ in range(group)]
        window = sde_window(steps, window_size, window_range, gen)
        ro = policy.rollout(prompts, [seed * 1000 + k * 100 + i for i in range(len(prompts))], window)
        r = torch.tensor(ocr(ro.images, truths), dtype=torch.float32)
        means.append(float(r.mean()))
        adv, _ = group_advantages(r, [w for w in truths], adv_clip_max=5.0)
        for p in params:
            p.grad = None
        for j, i in enumerate(window):  # the trainer's loss at ratio 1: -mean_b A_b * logp_b, summed over steps
            logp = policy.step(
                ro.conditioning, ro.window_latents[:, j], i, prev_sample=ro.window_latents[:, j + 1]
            ).log_prob
            (-(adv * logp).mean()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in params if p.grad is not None]).clone())
    g = torch.stack(grads)
    mean = g.mean(0)
    tr = float(((g - mean) ** 2).sum(1).mean() * batches / (batches - 1))
    snr = (float(mean.pow(2).sum()) - tr / batches) / tr
    unit = g / g.norm(dim=1, keepdim=True)
    cos = unit @ unit.T
    pair = float(cos[~torch.eye(batches, dtype=torch.bool)].mean())
    return {
        "batches": batches,
        "samples_per_batch": 4 * group,
        "snr": round(snr, 4),
        "mean_pairwise_cosine": round(pair, 4),
        "batch_reward_means": [round(m, 3) for m in means],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny:qwen_image_text_bimodal")
    ap.add_argument("--vocab", default="tiny_text_bimodal", choices=list(VOCABS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--what", default="reward,window,snr")
    ap.add_argument("--words", type=int, default=16, help="prompts per word set in `reward` and `window`")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--redraws", type=int, default=4)
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--window-size", type=int, default=2)
    ap.add_argument("--window-range", type=int, nargs=2, default=[0, 5])
    ap.add_argument("--noise-level", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    train, val, template = words_of(args.vocab)
    rng = random.Random(args.seed)
    train_words, val_words = rng.sample(train, args.words), rng.sample(val, min(args.words, len(val)))
    policy = DiffusionPolicy(
        args.model,
        SamplingConfig(height=64, width=64, num_inference_steps=10, noise_level=args.noise_level),
        lora_rank=8,
        lora_alpha=16,
        target_modules=["to_q", "to_k", "to_v", "to_out.0"],
    )
    res: dict = {"model": args.model, "args": vars(args)}
    t0 = time.time()
    what = args.what.split(",")
    wr = tuple(args.window_range)
    if "reward" in what:
        res["reward"] = {
            name: measure_reward(policy, template, ws, args.group, wr, args.window_size, args.seed)
            for name, ws in (("train_words", train_words), ("held_out_words", val_words))
        }
        print(json.dumps(res["reward"]), flush=True)
    if "window" in what:
        starts = list(range(0, 10 - args.window_size + 1, 2))
        res["window_noise_share"] = measure_window(
            policy, template, train_words * 2, args.redraws, args.window_size, starts, args.seed
        )
        print(json.dumps(res["window_noise_share"]), flush=True)
    if "snr" in what:
        res["gradient"] = measure_snr(
            policy, template, train, args.group, args.batches, wr, args.window_size, args.seed
        )
        print(json.dumps(res["gradient"]), flush=True)
    res["seconds"] = round(time.time() - t0)
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
