"""Pre-train ``tiny:qwen_image_text_bimodal``: a tiny Qwen-Image that draws a string legibly about half the time.

A base model whose text rendering is hit-or-miss, as real text-to-image models are: for the *same* prompt (e.g.
``Text "K4"``) the training images are drawn either **legibly** (black, large, centred) or **illegibly** (the same
layout in faint grey, Gaussian-blurred: PP-OCR reads nothing), half each, and the prompt does not say which. So
the initial noise decides the mode, the OCR reward of a GRPO group is a mix of ~1 and ~0, and FlowGRPO has a
direction to move: shift probability mass to the legible mode. (``tiny:qwen_image_text``, the previous renderer,
drew every sample partially legibly in the same way; its OCR reward did not rise under FlowGRPO on CPU:
``bench/results/ocr_learning_cpu.json``.)

Same diffusers classes and recipe as ``tiny_text_renderer.py`` (whose stage functions this script imports):
``AutoencoderKLQwenImage`` trained on the mix, latents normalised into the VAE config, a
``QwenImageTransformer2DModel`` trained by rectified flow conditioned on the frozen random tiny Qwen2.5-VL text
encoder's ``encode_prompt`` output, EMA weights, saved in fp16. Strings are the 2-character words over ``ALPHABET``
(196; a seeded 10 % held out and never trained on), drawn large (``FONT_SIZE``) so that the tiny 8x8-latent VAE
keeps them readable.

The illegible style was chosen by measurement (PP-OCR via ``omni_async.reward.scorers.ocr`` on clean 64x64
renders of 12 words): black text reads 1.0, so does grey down to fill 238, text 8 px high (0.95) or blur sigma 4
(1.0); faint *and* blurred fails: fill 200 + sigma 3 -> 0.0, fill 215 + sigma 2.5 -> 0.0 (fill 180 + sigma 3 ->
1.0). ``ILLEGIBLE_FILL`` / ``ILLEGIBLE_BLUR`` sit inside the failing region.

Usage (1 CPU thread; the VAE and latents are cached under ``--work`` so a re-run resumes)::

    python examples/pretrain/tiny_bimodal_renderer.py --out omni_async/models/weights/tiny_qwen_image_text_bimodal

It ends by scoring the saved pipeline through ``DiffusionPolicy`` and the OCR reward on training and held-out
words (``RUN_TIME`` and ``MEASURED`` below; the full JSON in ``--work``/eval.json).
"""

from __future__ import annotations

import itertools
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_text_renderer as base  # noqa: E402  (the shared stage functions)

ALPHABET = base.ALPHABET
HEIGHT, WIDTH = base.HEIGHT, base.WIDTH
FONT_SIZE, PITCH = 34, 28
LEGIBLE_FILL = (0, 40)  # grey level of legible text (0 = black), drawn uniformly
ILLEGIBLE_FILL = (205, 225)  # faint grey ...
ILLEGIBLE_BLUR = (3.0, 4.0)  # ... and blurred (Gaussian sigma, px): PP-OCR reads nothing
ILLEGIBLE_SHARE = 0.5
SEED = 0
RUN_TIME = (
    "shipped weights (defaults, 1 thread on a 2-core box shared with other jobs, load varying): first run, VAE 400 "
    "steps 1269 s + latents of 2832 renders 157 s; the second run (the shipped weights) reused both from --work "
    "(71 s to load and check them) and trained the transformer, 1800 steps, in 696 s: 768 s in all (~36 min from "
    "scratch), plus 215 s of evaluation"
)
MEASURED = (
    "VAE reconstructions of clean middle-valued renders of the held-out words: OCR 0.947 legible, 0.000 illegible. "
    "Saved pipeline, 10 steps, 19 held-out words x 4 seeds: ODE mean 0.329 (share >= 0.9: 0.184, <= 0.1: 0.526, "
    "5-bin histogram [40, 0, 22, 0, 14], within-word std 0.294), SDE (noise 0.7 on all steps) 0.375 (0.289 / 0.539); "
    "19 training words x 4 seeds: ODE 0.414 (0.289 / 0.461, histogram [35, 0, 19, 0, 22], within-word std 0.324), "
    "SDE 0.375 (0.250 / 0.500); re-evaluated after the OCR fix of 2026-11-26 (no angle classifier: held-out ODE was "
    "0.309 with it; the VAE figures above are from before it). Bimodal: a read is all, one of the two characters "
    "(0.5), or nothing"
)


def all_words() -> tuple[list[str], list[str]]:
    """(train, val): every 2-character word over ALPHABET, a seeded 10 % held out."""
    words = ["".join(p) for p in itertools.product(ALPHABET, repeat=2)]
    rng = random.Random(SEED)
    rng.shuffle(words)
    n_val = len(words) // 10
    return sorted(words[n_val:]), sorted(words[:n_val])


_FONTS: dict[int, object] = {}


def render(text: str, legible: bool, rng: random.Random | None = None) -> np.ndarray:
    """uint8 [H, W, 3]: ``text`` centred at a fixed pitch, legible (dark) or not (faint, blurred); with ``rng``
    the grey level, blur, position (+-2 px) and size (+-1 pt) vary, otherwise each takes its middle value."""
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    def draw(lo_hi: tuple[float, float]) -> float:
        return rng.uniform(*lo_hi) if rng else sum(lo_hi) / 2

    dx, dy = (rng.randint(-2, 2), rng.randint(-2, 2)) if rng else (0, 0)
    size = FONT_SIZE + (rng.randint(-1, 1) if rng else 0)
    if size not in _FONTS:
        _FONTS[size] = ImageFont.truetype(base.font_path(), size)
    fill = round(draw(LEGIBLE_FILL if legible else ILLEGIBLE_FILL))
    img = Image.new("RGB", (WIDTH, HEIGHT), "white")
    d = ImageDraw.Draw(img)
    n = len(text)
    for k, ch in enumerate(text):
        x = WIDTH / 2 + (k - (n - 1) / 2) * PITCH + dx
        d.text((x, HEIGHT / 2 + dy), ch, font=_FONTS[size], fill=(fill,) * 3, anchor="mm")
    if not legible:
        img = img.filter(ImageFilter.GaussianBlur(draw(ILLEGIBLE_BLUR)))
    return np.asarray(img)


# Qwen-Image's prompt template (diffusers' QwenImagePipeline.prompt_template_encode): the pipeline drops its first 34
# tokens (prompt_template_encode_start_idx), which with Qwen2.5-VL's real tokenizer are exactly the system block.
TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
    "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
# Pieces of the template whose words become single tokens (the rest of it is special tokens and newlines).
TEMPLATE_WORDS = ["system", TEMPLATE_PREFIX.split("\n")[1].removesuffix("<|im_end|>"), "user", "assistant"]


def build_tokenizer():
    """The tiny byte-level Qwen2 tokenizer (``omni_async.models.tiny.build_qwen2_tokenizer``) plus BPE merges that
    make each word of the template's system prompt one token, as Qwen2.5-VL's vocabulary does. The 34 tokens the
    pipeline drops are then exactly the system block (with bytes alone they were a third of it, and ~100 tokens of
    system prompt reached the transformer as conditioning); the prompt's own text stays one token per byte."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    from omni_async.models.tiny import _QWEN_CHAT_TEMPLATE, _QWEN_SPECIALS, _byte_level_alphabet

    vocab = {ch: i for i, ch in enumerate(_byte_level_alphabet())}
    merges = []
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = sorted({w for part in TEMPLATE_WORDS for w, _ in pre.pre_tokenize_str(part) if len(w) > 1})
    for w in words:
        for k in range(2, len(w) + 1):
            if w[:k] not in vocab:
                vocab[w[:k]] = len(vocab)
                merges.append((w[: k - 1], w[k - 1]))
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=1024)
    tok.add_special_tokens({"additional_special_tokens": _QWEN_SPECIALS[1:]})
    tok.add_tokens(["<|endoftext|>"], special_tokens=True)
    tok.chat_template = _QWEN_CHAT_TEMPLATE
    n = len(tok(TEMPLATE_PREFIX).input_ids)
    if n != 34:
        raise RuntimeError(f"the template's system block is {n} tokens, the pipeline drops 34")
    return tok


def build_pipeline(vae, transformer):
    from diffusers import QwenImagePipeline

    from omni_async.models.tiny import _flow_scheduler, _tiny_qwen25_vl_text_encoder

    tok = build_tokenizer()
    torch.manual_seed(1234)  # the text encoder's init seed in omni_async.models.tiny
    text_encoder = _tiny_qwen25_vl_text_encoder(len(tok), 32)
    return QwenImagePipeline(
        scheduler=_flow_scheduler(base.SHIFT),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=transformer,
    )


def train_vae(steps: int, batch: int, log) -> torch.nn.Module:
    """The Qwen-Image VAE on the legible / illegible mix (loss as ``tiny_text_renderer.train_vae``)."""
    torch.manual_seed(SEED)
    vae = base.new_vae()
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
        x = base.to_tensor(
            [
                render(
                    "".join(rng.choice(ALPHABET) for _ in range(rng.choice([1, 2, 2]))),
                    rng.random() >= ILLEGIBLE_SHARE,
                    rng,
                )
                for _ in range(batch)
            ]
        )
        mu = vae.encode(x).latent_dist.mean
        vae.decode(mu + 0.1 * mu.detach().std() * torch.randn_like(mu))
        rec = pre_clamp[-1]
        mse, l1 = (rec - x).pow(2).mean(), (rec - x).abs().mean()
        opt.zero_grad(set_to_none=True)
        (mse + l1).backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        sched.step()
        if it % 50 == 0 or it == steps - 1:
            log(f"vae {it:5d} mse {mse.item():.4f} l1 {l1.item():.4f} {time.time() - t0:.0f}s")
    hook.remove()
    return vae.eval()


def ocr_scores(images, words: list[str]) -> np.ndarray:
    from omni_async.reward.scorers.ocr import compute_score

    return np.array([compute_score("ocr", im, w)["score"] for im, w in zip(images, words, strict=True)])


@torch.no_grad()
def recon_ocr(vae, words: list[str], legible: bool) -> float:
    """Mean OCR score of the VAE's reconstructions of middle-valued renders (the ceiling / floor of each mode)."""
    x = base.to_tensor([render(w, legible) for w in words])
    rec = vae.decode(vae.encode(x).latent_dist.mean).sample[:, :, 0]
    rec = ((rec.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return float(ocr_scores(rec, words).mean())


def summarise(scores: np.ndarray) -> dict:
    """``scores`` [prompts, seeds]: mean, histogram, shares near 0 / 1, the within-group (per-prompt) spread."""
    flat = scores.ravel()
    return {
        "mean": round(float(flat.mean()), 3),
        "share_ge_0.9": round(float((flat >= 0.9).mean()), 3),
        "share_le_0.1": round(float((flat <= 0.1).mean()), 3),
        "histogram_0_to_1_in_5_bins": np.histogram(flat, bins=5, range=(0, 1))[0].tolist(),
        "within_group_std": round(float(scores.std(1).mean()), 3),
        "share_of_groups_all_equal": round(float((scores.std(1) == 0).mean()), 3),
        "per_seed_mean": scores.mean(0).round(3).tolist(),
    }


def evaluate(model_dir: str, sets: dict[str, list[str]], seeds: int, steps: int = 10, grid: str | None = None) -> dict:
    """OCR reward of the saved pipeline per word set, ODE and SDE (noise 0.7 on all steps), ``seeds`` per word."""
    from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig

    policy = DiffusionPolicy(
        model_dir, SamplingConfig(height=HEIGHT, width=WIDTH, num_inference_steps=steps, noise_level=0.7), lora_rank=0
    )
    result, rows = {}, []
    for name, words in sets.items():
        for mode, window in (("ode", None), ("sde", range(0, steps))):
            scores = np.zeros((len(words), seeds))
            for j in range(seeds):
                imgs = policy.rollout(
                    [base.prompt_of(w) for w in words], [j * 1000 + i for i in range(len(words))], window
                ).images
                scores[:, j] = ocr_scores(imgs, words)
                if name == "val" and mode == "ode" and j < 4:
                    rows.append(imgs[:16])
            result[f"{name}_{mode}"] = summarise(scores)
    if grid:
        from PIL import Image

        words = sets["val"][:16]
        top = [render(w, True) for w in words] + [render(w, False) for w in words]
        top = [np.concatenate(top[: len(words)], 1), np.concatenate(top[len(words) :], 1)]
        Image.fromarray(np.concatenate(top + [np.concatenate(list(r), 1) for r in rows], 0)).save(grid)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = base.stage_parser(
        __doc__.split("\n\n")[0],
        "omni_async/models/weights/tiny_qwen_image_text_bimodal",
        "/tmp/tiny_bimodal_renderer",
        16,
        "renders per training word, half of them illegible",
    )
    ap.add_argument("--eval-seeds", type=int, default=4, help="samples per word in the evaluation (a GRPO group)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    log = base.open_log(work)

    t_start = time.time()
    train_words, val_words = all_words()
    log(f"words: {len(train_words)} train, {len(val_words)} val; args {vars(args)}")

    # Stage 1: VAE -------------------------------------------------------------------------------------------
    vae_dir = work / "vae"
    if not (vae_dir / "config.json").exists():
        vae = train_vae(args.vae_steps, args.vae_batch, log)
        vae.save_pretrained(vae_dir)
    from diffusers import AutoencoderKLQwenImage

    vae = AutoencoderKLQwenImage.from_pretrained(vae_dir).eval()
    log(
        f"vae reconstruction OCR on held-out words: legible {recon_ocr(vae, val_words, True):.3f}, "
        f"illegible {recon_ocr(vae, val_words, False):.3f}"
    )

    # Latents: every training word in `variants` renders, alternately legible and illegible (exactly half each).
    lat_file = work / f"latents_v{args.variants}.pt"
    if not lat_file.exists():
        rng = random.Random(SEED + 3)
        imgs, widx = [], []
        for i, w in enumerate(train_words):
            for v in range(args.variants):
                imgs.append(render(w, v % 2 == 0, rng))
                widx.append(i)
        torch.save({"lat": base.encode_mean(vae, imgs), "widx": torch.tensor(widx)}, lat_file)
    d = torch.load(lat_file)
    raw, widx = d["lat"], d["widx"]
    packed = base.normalised_packed_latents(vae, raw)
    t_vae = time.time() - t_start
    log(f"latents {tuple(raw.shape)} -> packed {tuple(packed.shape)}; {t_vae:.0f}s so far")

    # Stage 2: transformer -----------------------------------------------------------------------------------
    torch.manual_seed(SEED + 4)
    transformer = base.new_transformer(vae.config.z_dim, 32, args.layers, args.heads, args.head_dim)
    pipe = build_pipeline(vae, transformer)
    emb, mask = base.encode_prompts(pipe, train_words)
    log(f"prompt embeddings {tuple(emb.shape)}; transformer params {sum(p.numel() for p in transformer.parameters())}")
    t_dit0 = time.time()
    base.train_transformer(pipe, packed, widx, emb, mask, args.dit_steps, args.dit_batch, args.dit_lr, log)
    t_dit = time.time() - t_dit0

    out = Path(args.out)
    base.save_renderer(pipe, out, [2], val_words)
    t_total = time.time() - t_start
    log(f"time: vae+latents {t_vae:.0f}s, transformer {t_dit:.0f}s, total {t_total:.0f}s")

    t_eval = time.time()
    sets = {"train": random.Random(SEED + 5).sample(train_words, len(val_words)), "val": val_words}
    res = evaluate(str(out), sets, args.eval_seeds, grid=str(work / "grid.png"))
    res["seconds"] = {
        "vae_and_latents": round(t_vae),
        "transformer": round(t_dit),
        "total": round(t_total),
        "evaluation": round(time.time() - t_eval),
    }
    (work / "eval.json").write_text(json.dumps(res, indent=1))
    log(json.dumps(res))


if __name__ == "__main__":
    main()
