"""Pre-train ``tiny:qwen_image_text``: a tiny Qwen-Image pipeline that draws short strings, partially legibly.

The default ``tiny:qwen_image`` has random weights, so the OCR reward reads nothing and FlowGRPO has no signal.
This script trains the same diffusers classes (``QwenImagePipeline``: ``AutoencoderKLQwenImage``,
``QwenImageTransformer2DModel``, and the tiny random Qwen2.5-VL text encoder + byte-level tokenizer that
``omni_async.models.tiny`` builds) on 64x64 renders of prompts such as ``Text "K47"``:

1. **VAE** (autoencoder stage): black DejaVu Sans Bold text on white, 1-3 characters from ``ALPHABET``, fixed
   pitch, small random jitter in position and size. Loss: pixel MSE + L1 on the decoded posterior mean
   (plus 10 % noise). The per-channel mean / std
   of the latents are written to the VAE config (``latents_mean`` / ``latents_std``), so the transformer
   sees unit-scale latents, exactly as the pipeline (and ``DiffusionPolicy.decode``) un-normalises them.
2. **Transformer** (rectified flow): packed VAE latents ``x0``, noise ``e``, ``x = (1 - s) x0 + s e``, target
   ``e - x0``, with ``s`` drawn as the pipeline's sigmas are spaced (uniform, then the scheduler's static shift 3)
   and given to the transformer as ``timestep = s`` (the pipeline passes ``t / 1000``). Conditioning is the
   pipeline's own ``encode_prompt`` output of the *frozen random* text encoder: its template puts the string's
   bytes at fixed token offsets, and each byte's hidden state is distinct, which is enough for joint attention to
   learn which glyph goes where. Weights are an EMA of the training weights.

Strings are all 2- and 3-character words over ``ALPHABET``; a seeded 10 % are held out (``val``) and never
trained on. The script ends by loading the saved pipeline through ``DiffusionPolicy`` and scoring held-out
prompts with ``omni_async.reward.scorers.ocr.compute_score`` (ODE and SDE sampling), and writes a sample grid.

Usage (1 CPU thread; stages are cached under ``--work`` so a re-run resumes)::

    python examples/pretrain/tiny_text_renderer.py --out omni_async/models/weights/tiny_qwen_image_text

Measured (the run that made the shipped weights; ``RUN_TIME`` below): ~14 min on one shared CPU thread. Its
evaluation, 48 held-out words x 3 seeds, 10 steps, 64x64: OCR mean 0.34 with the ODE (per-seed means 0.32 / 0.38 /
0.33; mean within-prompt std 0.19, 96 % of prompts differ across seeds), 0.38 with the SDE (noise_level 0.7 on all
10 steps; per seed 0.36 / 0.40 / 0.36). VAE reconstructions of clean renders read at 0.85 (the ceiling).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

ALPHABET = "123456789AEHKX"  # no 0 / O: PP-OCR swaps them between digits and capitals
HEIGHT = WIDTH = 64
FONT_SIZE, PITCH = 26, 20
SEED = 0
SHIFT = 3.0  # FlowMatchEulerDiscreteScheduler(shift=3.0), as tiny.py's builders use
RUN_TIME = (
    "shipped weights (defaults, 1 thread on a 2-core box shared with other jobs): VAE 400 steps 198 s, latents of "
    "7938 renders ~60 s, transformer 1800 steps 581 s; ~14 min in all, plus ~1 min of evaluation"
)


def prompt_of(text: str) -> str:
    return f'Text "{text}"'


def all_words() -> tuple[list[str], list[str]]:
    """(train, val) words: every 2- and 3-character word over ALPHABET, 10 % held out (seeded)."""
    words = ["".join(p) for n in (2, 3) for p in itertools.product(ALPHABET, repeat=n)]
    rng = random.Random(SEED)
    rng.shuffle(words)
    n_val = len(words) // 10
    return sorted(words[n_val:]), sorted(words[:n_val])


# ---------------------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------------------


def font_path() -> str:
    import matplotlib

    return os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "fonts", "ttf", "DejaVuSans-Bold.ttf")


_FONTS: dict[int, object] = {}


def render(text: str, rng: random.Random | None = None) -> np.ndarray:
    """uint8 [H, W, 3]: ``text`` centred at a fixed pitch; with ``rng``, jittered by up to 2 px and 1 pt."""
    from PIL import Image, ImageDraw, ImageFont

    dx = rng.randint(-2, 2) if rng else 0
    dy = rng.randint(-2, 2) if rng else 0
    size = FONT_SIZE + (rng.randint(-1, 1) if rng else 0)
    if size not in _FONTS:
        _FONTS[size] = ImageFont.truetype(font_path(), size)
    img = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(img)
    n = len(text)
    for k, ch in enumerate(text):
        x = WIDTH / 2 + (k - (n - 1) / 2) * PITCH + dx
        draw.text((x, HEIGHT / 2 + dy), ch, font=_FONTS[size], fill="black", anchor="mm")
    return np.asarray(img)


def to_tensor(images: list[np.ndarray]) -> torch.Tensor:
    """uint8 [H, W, 3] list -> float [B, 3, 1, H, W] in [-1, 1] (the Qwen-Image VAE takes a frame axis)."""
    x = torch.from_numpy(np.stack(images)).float().div(127.5).sub(1)
    return x.permute(0, 3, 1, 2).unsqueeze(2)


# ---------------------------------------------------------------------------------------------------------------
# Stage 1: VAE
# ---------------------------------------------------------------------------------------------------------------


def new_vae(z_dim: int = 16):
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * z_dim,
        latents_std=[1.0] * z_dim,
    )


def train_vae(steps: int, batch: int, log) -> torch.nn.Module:
    torch.manual_seed(SEED)
    vae = new_vae()
    rng = random.Random(SEED + 1)
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / 50) * 0.5 * (1 + math.cos(math.pi * i / steps))
    )
    pre_clamp: list[torch.Tensor] = []
    hook = vae.decoder.register_forward_hook(lambda m, i, o: pre_clamp.append(o))
    t0 = time.time()
    for it in range(steps):
        pre_clamp.clear()
        words = ["".join(rng.choice(ALPHABET) for _ in range(rng.choice([1, 2, 3, 3]))) for _ in range(batch)]
        x = to_tensor([render(w, rng) for w in words])
        mu = vae.encode(x).latent_dist.mean
        # Decode the posterior mean plus noise at 10 % of its scale: a near-deterministic autoencoder (the prior
        # posterior std of ~1 would drown the small initial means and stall training on blank images), robust
        # to the small latent errors a diffusion model makes.
        vae.decode(mu + 0.1 * mu.detach().std() * torch.randn_like(mu))
        rec = pre_clamp[-1]  # decode() clamps to [-1, 1], which zeroes the gradient of saturated pixels
        mse, l1 = (rec - x).pow(2).mean(), (rec - x).abs().mean()
        loss = mse + l1
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        sched.step()
        if it % 50 == 0 or it == steps - 1:
            log(f"vae {it:5d} mse {mse.item():.4f} l1 {l1.item():.4f} {time.time() - t0:.0f}s")
    hook.remove()
    return vae.eval()


@torch.no_grad()
def encode_mean(vae, images: list[np.ndarray], batch: int = 64) -> torch.Tensor:
    out = [vae.encode(to_tensor(images[i : i + batch])).latent_dist.mean for i in range(0, len(images), batch)]
    return torch.cat(out)[:, :, 0]  # [N, z, h, w]


@torch.no_grad()
def recon_ocr(vae, words: list[str]) -> float:
    """Mean OCR score of the VAE's reconstructions of clean renders: the ceiling the transformer can reach."""
    from omni_async.reward.scorers.ocr import compute_score

    rec = vae.decode(vae.encode(to_tensor([render(w) for w in words])).latent_dist.mean).sample[:, :, 0]
    rec = ((rec.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return float(np.mean([compute_score("ocr", r, w)["score"] for r, w in zip(rec, words, strict=True)]))


# ---------------------------------------------------------------------------------------------------------------
# Stage 2: transformer
# ---------------------------------------------------------------------------------------------------------------


def new_transformer(z_dim: int, text_dim: int, layers: int, heads: int, head_dim: int):
    from diffusers import QwenImageTransformer2DModel

    rope = (head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8)
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * z_dim,
        out_channels=z_dim,
        num_layers=layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=text_dim,
        axes_dims_rope=rope,
    )


def build_pipeline(vae, transformer):
    from diffusers import QwenImagePipeline

    from omni_async.models.tiny import _flow_scheduler, _tiny_qwen25_vl_text_encoder, build_qwen2_tokenizer

    tok = build_qwen2_tokenizer()
    torch.manual_seed(1234)  # the same text encoder tiny:qwen_image gets (tiny.py's build seed)
    text_encoder = _tiny_qwen25_vl_text_encoder(len(tok), 32)
    return QwenImagePipeline(
        scheduler=_flow_scheduler(SHIFT), vae=vae, text_encoder=text_encoder, tokenizer=tok, transformer=transformer
    )


@torch.no_grad()
def encode_prompts(pipe, words: list[str], batch: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt embeddings exactly as the pipeline makes them, padded to one length (mask 0 on the pad)."""
    embs, masks = [], []
    for i in range(0, len(words), batch):
        e, m = pipe.encode_prompt(prompt=[prompt_of(w) for w in words[i : i + batch]], device="cpu")
        m = torch.ones(e.shape[:2], dtype=torch.long) if m is None else m  # None when no prompt is padded
        embs.append(e)
        masks.append(m)
    L = max(e.shape[1] for e in embs)
    emb = torch.cat([torch.nn.functional.pad(e, (0, 0, 0, L - e.shape[1])) for e in embs])
    mask = torch.cat([torch.nn.functional.pad(m, (0, L - m.shape[1])) for m in masks])
    return emb, mask


def shifted(u: torch.Tensor) -> torch.Tensor:
    return SHIFT * u / (1 + (SHIFT - 1) * u)


def train_transformer(
    pipe,
    lat: torch.Tensor,
    word_idx: torch.Tensor,
    emb: torch.Tensor,
    mask: torch.Tensor,
    steps: int,
    batch: int,
    lr: float,
    log,
) -> None:
    """Rectified flow on packed latents ``lat`` [N, seq, 4z]; sample ``i`` is conditioned on emb[word_idx[i]]."""
    tr = pipe.transformer
    ema = {k: v.detach().clone() for k, v in tr.state_dict().items()}
    opt = torch.optim.AdamW(tr.parameters(), lr=lr, weight_decay=0.01)
    warm = 200
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)))
    )
    g = torch.Generator().manual_seed(SEED + 2)
    side = HEIGHT // pipe.vae_scale_factor // 2
    shapes = [[(1, side, WIDTH // pipe.vae_scale_factor // 2)]] * batch
    t0, run = time.time(), 0.0
    tr.train()
    for it in range(steps):
        idx = torch.randint(0, lat.shape[0], (batch,), generator=g)
        x0 = lat[idx]
        e, m = emb[word_idx[idx]], mask[word_idx[idx]]
        noise = torch.randn(x0.shape, generator=g)
        s = shifted(torch.rand(batch, generator=g))
        xs = (1 - s[:, None, None]) * x0 + s[:, None, None] * noise
        v = tr(
            hidden_states=xs,
            timestep=s,
            guidance=None,
            encoder_hidden_states=e,
            encoder_hidden_states_mask=m,
            img_shapes=shapes,
            return_dict=False,
        )[0]
        loss = (v - (noise - x0)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tr.parameters(), 1.0)
        opt.step()
        sched.step()
        decay = min(0.999, (1 + it) / (10 + it))
        with torch.no_grad():
            for k, p in tr.state_dict().items():
                ema[k].mul_(decay).add_(p, alpha=1 - decay) if p.dtype.is_floating_point else ema[k].copy_(p)
        run = loss.item() if it == 0 else 0.98 * run + 0.02 * loss.item()
        if it % 100 == 0 or it == steps - 1:
            log(f"dit {it:5d} loss {run:.4f} lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s")
    tr.load_state_dict(ema)
    tr.eval()


# ---------------------------------------------------------------------------------------------------------------
# Evaluation through the project's own policy and reward
# ---------------------------------------------------------------------------------------------------------------


def evaluate(model_dir: str, words: list[str], seeds: list[int], steps: int = 10, grid: str | None = None) -> dict:
    from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig
    from omni_async.reward.scorers.ocr import compute_score

    policy = DiffusionPolicy(
        model_dir, SamplingConfig(height=HEIGHT, width=WIDTH, num_inference_steps=steps, noise_level=0.7), lora_rank=0
    )
    result, rows = {}, []
    for mode, window in (("ode", None), ("sde", range(0, steps))):
        scores = np.zeros((len(words), len(seeds)))
        for j, s in enumerate(seeds):
            imgs = policy.rollout(
                [prompt_of(w) for w in words], [s * 1000 + i for i in range(len(words))], window
            ).images
            for i, w in enumerate(words):
                scores[i, j] = compute_score("ocr", imgs[i], w)["score"]
            if j == 0:
                rows.append(imgs)
        per_word = scores.mean(1)
        result[mode] = {
            "mean": float(scores.mean()),
            "per_seed_mean": scores.mean(0).round(3).tolist(),
            "within_prompt_std": float(scores.std(1).mean()),
            "frac_prompts_with_spread": float((scores.std(1) > 0).mean()),
            "best_words": [words[i] for i in np.argsort(-per_word)[:5]],
        }
    if grid:
        from PIL import Image

        n = min(16, len(words))
        top = [render(w) for w in words[:n]]
        Image.fromarray(np.concatenate([np.concatenate(r[:n], 1) for r in [top, *rows]], 0)).save(grid)
    return result


# ---------------------------------------------------------------------------------------------------------------


def stage_parser(description: str, out: str, work: str, variants: int, variants_help: str) -> argparse.ArgumentParser:
    """The flags both pre-training scripts share (stage sizes, transformer shape, threads)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default=out)
    ap.add_argument("--work", default=work)
    ap.add_argument("--vae-steps", type=int, default=400)
    ap.add_argument("--vae-batch", type=int, default=16)
    ap.add_argument("--dit-steps", type=int, default=1800)
    ap.add_argument("--dit-batch", type=int, default=48)
    ap.add_argument("--dit-lr", type=float, default=1e-3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--variants", type=int, default=variants, help=variants_help)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="1 is ~7x faster than 2 on a shared 2-core box (OpenMP spin-waits under contention)",
    )
    return ap


def open_log(work: Path):
    """``log(msg)``: print and append to ``work``/log.txt (a re-run resumes, so the file keeps every run)."""
    work.mkdir(parents=True, exist_ok=True)
    logf = open(work / "log.txt", "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    return log


def normalised_packed_latents(vae, raw: torch.Tensor) -> torch.Tensor:
    """Write the per-channel mean / std of ``raw`` [N, z, h, w] into the VAE config (the pipeline un-normalises
    with them) and return the normalised latents packed as the transformer sees them, [N, seq, 4z]."""
    from diffusers import QwenImagePipeline

    mean, std = raw.mean((0, 2, 3)), raw.std((0, 2, 3))
    vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
    z = vae.config.z_dim
    norm = (raw - mean.view(1, z, 1, 1)) / std.view(1, z, 1, 1)
    h, w = norm.shape[-2:]
    return QwenImagePipeline._pack_latents(norm, norm.shape[0], z, h, w).contiguous()


def save_renderer(pipe, out: Path, lengths: list[int], val_words: list[str]) -> None:
    """The pipeline in fp16 (small files; DiffusionPolicy loads float32) plus the prompts.json ``tiny.py`` reads."""
    if out.exists():
        shutil.rmtree(out)
    pipe.to(torch.float16).save_pretrained(out)
    (out / "prompts.json").write_text(
        json.dumps(
            {
                "template": prompt_of("{text}"),
                "alphabet": ALPHABET,
                "lengths": lengths,
                "height": HEIGHT,
                "width": WIDTH,
                "val": val_words,
            },
            indent=0,
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> None:
    ap = stage_parser(
        __doc__.split("\n\n")[0],
        "omni_async/models/weights/tiny_qwen_image_text",
        "/tmp/tiny_text_renderer",
        3,
        "jittered renders per training word",
    )
    ap.add_argument("--eval-words", type=int, default=48)
    ap.add_argument("--eval-seeds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    log = open_log(work)

    t_start = time.time()
    train_words, val_words = all_words()
    log(f"words: {len(train_words)} train, {len(val_words)} val; args {vars(args)}")

    # Stage 1 ------------------------------------------------------------------------------------------------
    vae_dir = work / "vae"
    if not (vae_dir / "config.json").exists():
        vae = train_vae(args.vae_steps, args.vae_batch, log)
        vae.save_pretrained(vae_dir)
    from diffusers import AutoencoderKLQwenImage

    vae = AutoencoderKLQwenImage.from_pretrained(vae_dir).eval()
    t_vae = time.time() - t_start
    log(f"vae reconstruction OCR on 32 held-out words: {recon_ocr(vae, val_words[:32]):.3f}")

    # Latents of the training renders; normalisation stats written into the VAE config.
    lat_file = work / f"latents_v{args.variants}.pt"
    if not lat_file.exists():
        rng = random.Random(SEED + 3)
        imgs, widx = [], []
        for i, w in enumerate(train_words):
            for v in range(args.variants):
                imgs.append(render(w, rng if v else None))
                widx.append(i)
        torch.save({"lat": encode_mean(vae, imgs), "widx": torch.tensor(widx)}, lat_file)
    d = torch.load(lat_file)
    raw, widx = d["lat"], d["widx"]
    packed = normalised_packed_latents(vae, raw)
    log(
        f"latents {tuple(raw.shape)} -> packed {tuple(packed.shape)}; raw std per channel "
        f"{raw.std((0, 2, 3)).numpy().round(3)}"
    )

    # Stage 2 ------------------------------------------------------------------------------------------------
    torch.manual_seed(SEED + 4)
    transformer = new_transformer(vae.config.z_dim, 32, args.layers, args.heads, args.head_dim)
    pipe = build_pipeline(vae, transformer)
    emb, mask = encode_prompts(pipe, train_words)
    log(f"prompt embeddings {tuple(emb.shape)}; transformer params {sum(p.numel() for p in transformer.parameters())}")
    t_dit0 = time.time()
    train_transformer(pipe, packed, widx, emb, mask, args.dit_steps, args.dit_batch, args.dit_lr, log)
    t_dit = time.time() - t_dit0

    out = Path(args.out)
    save_renderer(pipe, out, [2, 3], val_words)
    t_total = time.time() - t_start
    log(f"time: vae+latents {t_vae:.0f}s, transformer {t_dit:.0f}s, total {t_total:.0f}s")

    rng = random.Random(SEED + 5)
    words = rng.sample(val_words, args.eval_words)
    res = evaluate(str(out), words, list(range(args.eval_seeds)), grid=str(work / "grid.png"))
    log(json.dumps(res))


if __name__ == "__main__":
    main()
