"""Qwen-Image-Edit (``QwenImageEditPlusPipeline``, ``tiny:qwen_image_edit``): edit rows in verl-omni's columns read
from parquet or jsonl (images as bytes or paths), bad rows named by row and column; the rollout conditions on each
row's input images and the update's recompute of the same conditioning gives the rollout's log-probs; the reward
function gets the input images beside the output (``extra_info["condition_images"]``)."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omni_async.models.diffusion_policy import IMAGE_LATENTS, DiffusionPolicy, SamplingConfig
from omni_async.reward.manager import RewardManager
from omni_async.sample import EditPrompt, ImageResult, PromptRow, Sample
from omni_async.trainer.dataset import DatasetError, load_prompts

EXAMPLES = Path(__file__).resolve().parents[2] / "examples/data"
sys.path.insert(0, str(EXAMPLES))
from prepare_qwen_image_edit import row  # noqa: E402


def png(color: tuple[int, int, int], size: int = 32) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return buf.getvalue()


def test_the_shipped_edit_set_reads_as_verl_omnis_rows():
    rows = load_prompts(str(EXAMPLES / "qwen_image_edit/train.parquet"))
    assert len(rows) == 4 and len(load_prompts(str(EXAMPLES / "qwen_image_edit/test.parquet"))) == 2
    first = rows[0]
    assert first.prompt == first.ground_truth == "Change the background to blue"  # "Picture 1: <image>" dropped
    assert first.data_source == "image_edit" and len(first.images) == 1
    assert first.request == EditPrompt(first.prompt, first.images)
    assert Image.open(io.BytesIO(first.images[0])).size == (32, 32)  # letterboxed to the output's square


def test_edit_rows_from_jsonl_with_paths_and_bad_rows_name_row_and_column(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img/a.png").write_bytes(png((255, 0, 0)))
    good = row("train", 0, "Make it blue", b"", "a.png") | {"images": ["img/a.png"]}  # a path, relative to the file
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(good) + "\n")
    (r,) = load_prompts(str(data))
    assert r.images == ((tmp_path / "img/a.png").read_bytes(),) and r.prompt == "Make it blue"
    assert PromptRow("x", "ocr", "x").request == "x"  # a row without images asks for a plain prompt

    bad = [  # (column the error names, words, the row's change)
        ("'images[0]'", "not a decodable image", {"images": [{"path": "train.jsonl"}]}),
        ("'images[0]'", "not found", {"images": ["img/missing.png"]}),
        ("'images'", "non-empty list", {"images": []}),
        ("'prompt'", "marks 2 input image(s)", {"prompt": [{"role": "user", "content": "Picture 1: <image><image>x"}]}),
    ]
    for column, words, change in bad:
        data.write_text(json.dumps(good) + "\n" + json.dumps({**good, **change}) + "\n")
        with pytest.raises(DatasetError, match=rf"train\.jsonl:row 2: field {re.escape(column)}.*{re.escape(words)}"):
            load_prompts(str(data))


@pytest.fixture(scope="module")
def policy():
    cfg = SamplingConfig(height=32, width=32, num_inference_steps=3, true_cfg_scale=4.0)
    return DiffusionPolicy("tiny:qwen_image_edit", cfg, lora_rank=4, device="cpu", dtype=torch.float32)


def test_rollout_conditions_on_the_input_images_and_the_update_recomputes_the_same(policy):
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    prompts = [EditPrompt("make it green", (red,)), EditPrompt("make it green", (blue,))]
    out = policy.rollout(prompts, [7, 7], range(1, 3))  # one seed: only the input image differs
    cond = out.conditioning
    assert cond[IMAGE_LATENTS].shape == (2, 16, 64)  # 64x64 input -> 8x8 latents -> 4x4 packed tokens of 16x4
    assert not torch.equal(cond[IMAGE_LATENTS][0], cond[IMAGE_LATENTS][1])
    # the same noise, another input image: another trajectory
    assert (out.window_latents[0, -1] - out.window_latents[1, -1]).abs().max() > 1e-3
    # the update's recompute from the carried conditioning (no text encoder, no VAE) gives the rollout's log-probs
    carried = policy.conditioning_from({k: v.clone() for k, v in cond.items()})
    for j in range(2):
        step = policy.step(carried, out.window_latents[:, j], 1 + j, prev_sample=out.window_latents[:, j + 1])
        torch.testing.assert_close(step.log_prob, out.log_probs[:, j], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="has none. Fix: give the dataset rows an 'images' column"):
        policy.rollout(["make it green"], [1], None)
    with pytest.raises(ValueError, match="output's aspect ratio"):
        policy.rollout([EditPrompt("x", (_wide(),))], [1], None)


def _wide() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (48, 32)).save(buf, format="PNG")
    return buf.getvalue()


async def test_the_reward_function_gets_the_input_images_beside_the_output(tmp_path):
    fn = tmp_path / "edit_reward.py"
    fn.write_text(
        "def compute_score(data_source, solution_image, ground_truth, extra_info, **kw):\n"
        "    (inp,) = extra_info['condition_images']\n"
        "    return {'score': float((solution_image.float() - inp.float()).abs().mean()),\n"
        "            'input_shape': list(inp.shape), 'output_shape': list(solution_image.shape)}\n"
    )
    from omegaconf import OmegaConf

    from omni_async.reward import contract
    from omni_async.reward.worker import proto_to_sample, sample_to_proto

    cfg = OmegaConf.load(Path(contract.__file__).parents[1] / "config/flowgrpo_trainer.yaml").reward
    cfg.custom_reward_function.path, cfg.custom_reward_function.name = str(fn), "compute_score"
    manager = RewardManager(cfg)
    s = Sample(0, "u", PromptRow("make it blue", "image_edit", "make it blue", images=(png((255, 0, 0)),)), 0)
    s.result = ImageResult(
        pixels=np.zeros((32, 32, 3), np.uint8), window_latents=torch.zeros(0), log_probs=torch.zeros(0)
    )
    outcome = await manager.score(proto_to_sample(sample_to_proto(s.reward_input())))  # as a reward worker gets it
    assert outcome.ok, outcome.error
    assert outcome.extra["input_shape"] == outcome.extra["output_shape"] == [3, 32, 32]
    assert outcome.score == pytest.approx(255 / 3)  # a black output against a red input: the red channel differs


def test_tiny_edit_model_is_the_published_layout():
    from omni_async.models.tiny import resolve_model_path

    path = Path(resolve_model_path("tiny:qwen_image_edit"))
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPlusPipeline"
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    cfg = json.loads((path / "transformer/config.json").read_text())
    assert cfg["zero_cond_t"] is True


def test_the_older_edit_pipeline_takes_one_input_image():
    """``QwenImageEditPipeline`` (Qwen-Image-Edit before Plus): its own template and one image per prompt, the same
    carried conditioning; two images are refused naming the pipeline."""
    from diffusers import DiffusionPipeline, QwenImageEditPipeline

    from omni_async.models.qwen_image_edit import edit_load_kwargs
    from omni_async.models.tiny import resolve_model_path

    path = resolve_model_path("tiny:qwen_image_edit")
    pipe = QwenImageEditPipeline(**DiffusionPipeline.from_pretrained(path, **edit_load_kwargs(path)).components)
    pipe.register_to_config(_name_or_path=path)  # the stand-in's VAE size, as a checkpoint of this class would give
    cfg = SamplingConfig(height=32, width=32, num_inference_steps=3, true_cfg_scale=4.0)
    old = DiffusionPolicy(pipe, cfg, lora_rank=4, device="cpu", dtype=torch.float32)
    out = old.rollout([EditPrompt("make it green", (png((255, 0, 0)),))], [3], range(0, 2))
    carried = old.conditioning_from({k: v.clone() for k, v in out.conditioning.items()})
    step = old.step(carried, out.window_latents[:, 1], 1, prev_sample=out.window_latents[:, 2])
    torch.testing.assert_close(step.log_prob, out.log_probs[:, 1], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="QwenImageEditPipeline edits one input image per prompt, got 2"):
        old.rollout([EditPrompt("x", (png((1, 2, 3)), png((3, 2, 1))))], [1], None)


def test_rows_with_input_images_are_refused_by_a_text_to_image_model():
    t2i = DiffusionPolicy("tiny:qwen_image", SamplingConfig(height=32, width=32, num_inference_steps=1), device="cpu")
    with pytest.raises(ValueError, match="carry input images .* QwenImagePipeline generates from text only. Fix:"):
        t2i.rollout([EditPrompt("make it green", (png((255, 0, 0)),))], [1], None)


def test_ode_rollout_is_the_pipelines_own_edit(policy, monkeypatch):
    """Without an SDE window the rollout is ``QwenImageEditPlusPipeline.__call__``'s own edit (same seed, input image,
    instruction, true CFG with its " " negative prompt): the same final latents to float rounding, so the conditioning
    is the pipeline's (another input image moves them by ~4e-2, another instruction by ~9e-3). The pipeline's VAE
    size is the stand-in's (module docstring of ``models.qwen_image_edit``)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", 64 * 64)
    image = png((200, 30, 30))
    ours = policy.with_sampling(clean_latents=True).rollout([EditPrompt("make it green", (image,))], [5], None)
    theirs = policy.pipe(
        image=[Image.open(io.BytesIO(image)).convert("RGB")],
        prompt="make it green",
        negative_prompt=" ",
        true_cfg_scale=4.0,
        height=32,
        width=32,
        num_inference_steps=3,
        generator=torch.Generator().manual_seed(5),
        output_type="latent",
    ).images
    torch.testing.assert_close(ours.final_latents, theirs.float(), rtol=0, atol=1e-5)
