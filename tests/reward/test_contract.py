"""The reward-function contract with verl / verl-omni: uint8 ``(C, H, W)`` / ``(C, F, H, W)`` tensors, each of several
rewards called with the arguments it declares, data_source dispatch, start-up checks.

verl-omni's own reward files (``verl_omni_rewards/``: ``jpeg_compressibility.py``, ``genrm_ocr.py``) are called here
unchanged; the functions of ``rewards_for_tests.py`` take their signatures and read their inputs as they do.
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi import Request  # at module level: FastAPI resolves the handler's string annotation in its globals
from omegaconf import OmegaConf
from PIL import Image, ImageDraw, ImageFont

from omni_async.reward import contract
from omni_async.reward.contract import (
    RewardConfigError,
    UnknownDataSourceError,
    check_reward_function,
    default_compute_score,
)
from omni_async.reward.manager import RewardManager
from omni_async.reward.pixels import RewardContractError, to_pixels, to_solution_image
from omni_async.reward.scorers import jpeg, ocr, simulated, vlm_judge

TEST_REWARDS = str(Path(__file__).with_name("rewards_for_tests.py"))
_spec = importlib.util.spec_from_file_location("rewards_for_tests", TEST_REWARDS)
rft = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rft)
# verl-omni's reward files, unchanged (verl_omni_rewards/README.md); the directory is what upstream's imports resolve
VERL_OMNI = Path(__file__).with_name("verl_omni_rewards")
VERL_OMNI_SCORES = VERL_OMNI / "verl_omni/utils/reward_score"
VERL_OMNI_JPEG = str(VERL_OMNI_SCORES / "jpeg_compressibility.py")
VERL_OMNI_GENRM = str(VERL_OMNI_SCORES / "genrm_ocr.py")


def noise(seed: int, shape=(24, 32, 3)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def text_image(text: str, size=(256, 96)) -> np.ndarray:
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).text((16, 24), text, fill="black", font=ImageFont.load_default(size=40))
    return np.asarray(img)


def jpeg_kb_of(hwc: np.ndarray) -> float:
    buf = io.BytesIO()
    Image.fromarray(hwc).save(buf, format="JPEG", quality=95)
    return buf.tell() / 1000.0


# ------------------------------------------------------------------------------------------ to_solution_image


def test_to_solution_image_is_verl_omni_layout_for_image_and_video():
    img = noise(0)
    t = to_solution_image(img)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.is_contiguous()
    assert tuple(t.shape) == (3, 24, 32)
    assert torch.equal(t.permute(1, 2, 0), torch.from_numpy(img))
    video = noise(1, (5, 24, 32, 3))
    tv = to_solution_image(video)  # channels, then frames: what verl-omni's video rewards read
    assert tuple(tv.shape) == (3, 5, 24, 32) and tv.is_contiguous()
    assert torch.equal(tv[:, 3].permute(1, 2, 0), torch.from_numpy(video[3]))
    three = noise(2, (3, 24, 32, 3))  # 3 frames: still (C, F, H, W), by rank and type, never by the sizes
    assert torch.equal(to_solution_image(three)[:, 1].permute(1, 2, 0), torch.from_numpy(three[1]))
    assert np.array_equal(to_pixels(to_solution_image(three)), three)
    # round trip, and the other accepted forms
    assert np.array_equal(to_pixels(t), img) and np.array_equal(to_pixels(tv), video)
    assert np.array_equal(to_pixels(Image.fromarray(img)), img)
    assert np.array_equal(to_pixels(list(video)), video) and np.array_equal(to_pixels(list(tv.unbind(1))), video)
    assert torch.equal(to_solution_image(t), t)
    assert tuple(to_solution_image(img[..., 0]).shape) == (3, 24, 32)  # grey made RGB


@pytest.mark.parametrize(
    "bad, match",
    [
        (np.zeros((8, 8, 3), np.float32), "uint8"),
        (torch.zeros(3, 8, 8), "uint8 tensor"),
        (torch.zeros(8, 8, 3, dtype=torch.uint8), "channels-last"),
        (torch.zeros(5, 3, 8, 8, dtype=torch.uint8), r"frames-first \(F, C, H, W\).*permute\(1, 0, 2, 3\)"),
        (np.zeros((3, 8, 8), np.uint8), "channels-first"),
        (np.zeros((2, 2, 8, 8, 3), np.uint8), r"\(H, W, 3\)"),
    ],
)
def test_wrong_pixel_forms_are_named(bad, match):
    with pytest.raises(RewardContractError, match=match):
        to_pixels(bad)
    with pytest.raises(RewardContractError, match=match):
        to_solution_image(bad)


# ------------------------------------------------------------------ verl-omni's reward files and signatures


def _load(path: str, name: str):
    return check_reward_function(path, name)


def test_verl_omni_jpeg_compressibility_scores_what_we_pass_and_fails_on_numpy():
    upstream = _load(VERL_OMNI_JPEG, "compute_score")
    a, b = noise(0, (64, 64, 3)), noise(1, (64, 64, 3))
    b[0] = a[0]
    b[32:] = 255  # b compresses far better
    with_tensor = [upstream(to_solution_image(x)) for x in (a, b)]
    assert with_tensor == [pytest.approx(-jpeg_kb_of(x) / 500) for x in (a, b)]
    assert with_tensor[1] > with_tensor[0]
    # Upstream does not check its input: a numpy (H, W, 3) array is iterated row by row and scores the first row,
    # the same wrong score for both images -- the bug that passing verl-omni's tensor removes.
    assert upstream(a) == upstream(b)


def _manager(reward: dict) -> RewardManager:
    cfg = OmegaConf.load(Path(contract.__file__).parents[1] / "config/flowgrpo_trainer.yaml").reward
    for key, value in reward.items():
        cfg[key] = value
    return RewardManager(cfg)


def _sample(pixels, ground_truth="g", extra_info=None) -> dict:
    return {
        "prompt": "p",
        "data_source": "d",
        "ground_truth": ground_truth,
        "extra_info": dict(extra_info or {}),
        "uid": "u",
        "solution_image": pixels,
    }


def test_each_of_several_rewards_gets_only_the_arguments_it_declares():
    """verl-omni's multi-reward recipe: its jpeg_compressibility.compute_score(solution_image) beside a function
    with verl-omni's HTTP-client signature (an entry's extra field as a keyword): each is called with what it
    declares (all with **kwargs) and they combine as the weighted sum, reported per key as verl-omni does."""
    img = noise(3)
    manager = _manager(
        {
            "reward_functions": {
                "jpeg": {"path": VERL_OMNI_JPEG, "name": "compute_score", "weight": 0.5},
                "red": {"path": TEST_REWARDS, "name": "http_client_signature", "weight": 0.5, "server_url": "u:1"},
            }
        }
    )
    out = asyncio.run(manager.score(_sample(img)))
    assert out.ok, out.error
    jpeg_part, red = -jpeg_kb_of(img) / 500, img[..., 0].mean() / 255
    assert out.parts == {"jpeg": pytest.approx(jpeg_part), "red": pytest.approx(red)}
    assert out.score == pytest.approx(0.5 * jpeg_part + 0.5 * red)
    assert out.extra["server"] == "u:1" and out.extra["reward/combined"] == pytest.approx(out.score)
    # The single reward is called with all four arguments, as verl-omni's VisualRewardManager calls it: a function
    # that declares only solution_image is refused there at start, naming the key and the call.
    single = {"custom_reward_function": {"path": VERL_OMNI_JPEG, "name": "compute_score", "reward_kwargs": {}}}
    with pytest.raises(RewardConfigError, match=r"reward.custom_reward_function: compute_score\(solution_image\)"):
        check_reward_function(VERL_OMNI_JPEG, "compute_score", "reward.custom_reward_function", {}, "image")
    assert not asyncio.run(_manager(single).score(_sample(img))).ok  # and fails per sample if not checked first
    assert check_reward_function(
        VERL_OMNI_JPEG, "compute_score", "reward.reward_functions.jpeg", {}, "image", only_declared=True
    )


def test_a_reward_entry_missing_a_required_argument_is_refused_at_start(tmp_path):
    mod = tmp_path / "r.py"
    mod.write_text("def thresholded(solution_image, threshold):\n    return 1.0\n")
    with pytest.raises(RewardConfigError) as e:
        check_reward_function(str(mod), "thresholded", "reward.reward_functions.t", {}, "image", only_declared=True)
    msg = str(e.value)
    assert msg.startswith("reward.reward_functions.t:") and "threshold" in msg and "set them in the entry" in msg
    # The entry's extra field supplies it.
    check_reward_function(
        str(mod), "thresholded", "reward.reward_functions.t", {"threshold": 0.5}, "image", only_declared=True
    )


class _FrameJudge:
    """An OpenAI-compatible chat server on loopback that "reads" an image as ``text`` when its pixels are exactly
    one of ``frames`` (PNG is lossless) and as ``""`` otherwise, recording which frame each request carried."""

    def __init__(self, frames: np.ndarray, text: str):
        from fastapi import FastAPI
        from judge_test_servers import ThreadServer

        self.index = {f.tobytes(): i for i, f in enumerate(frames)}
        self.seen: list[int | None] = []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            import base64

            body = await request.json()
            url = next(p["image_url"]["url"] for p in body["messages"][1]["content"] if p["type"] == "image_url")
            pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))
            self.seen.append(self.index.get(pixels.tobytes()))
            content = text if self.seen[-1] is not None else ""
            return {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}
                ],
            }

        self.server = ThreadServer(app)
        self.address = f"127.0.0.1:{self.server.port}"


def test_verl_omni_genrm_ocr_reads_our_videos_frame_by_frame(monkeypatch):
    """verl-omni's own GenRM-OCR reward, as a sub-reward: it reads a 4-D tensor whose last axis is not 1 or 3 as
    [C, F, H, W] and sends every 4th frame to the judge. With what we pass, the judge gets frames 0, 4, 8 of the
    video, whole and in order (a frames-first tensor would reach it as 3 'frames' of F x H x W and fail)."""
    monkeypatch.syspath_prepend(str(VERL_OMNI))  # upstream imports verl_omni.utils.reward_score.reward_utils
    video = noise(9, (9, 16, 20, 3))
    judge = _FrameJudge(video, "HELLO")
    try:
        manager = _manager(
            {
                "reward_functions": {
                    "ocr": {
                        "path": VERL_OMNI_GENRM,
                        "name": "compute_score_ocr",
                        "reward_router_address": judge.address,
                    }
                }
            }
        )
        out = asyncio.run(manager.score(_sample(video, ground_truth="HELLO")))
        assert out.ok, out.error
        assert judge.seen == [0, 4, 8] and out.score == 1.0 and out.extra["genrm_response"] == "HELLO"
        judge.seen.clear()
        image = asyncio.run(manager.score(_sample(video[5], ground_truth="HELLO")))
        assert image.ok and judge.seen == [5] and image.score == 1.0
    finally:
        judge.server.stop()


def test_a_cfhw_only_video_reward_gets_cfhw_and_refuses_the_rest():
    video = noise(10, (6, 16, 20, 3))
    manager = _manager(
        {"custom_reward_function": {"path": TEST_REWARDS, "name": "cfhw_video_score", "reward_kwargs": {}}}
    )
    out = asyncio.run(manager.score(_sample(video, extra_info={"frame_interval": 2})))
    assert out.ok, out.error
    assert out.extra["frames"] == 3
    assert out.score == pytest.approx(np.mean([f[..., 0].mean() for f in video[::2]]) / 255)
    with pytest.raises(ValueError, match=r"\[C, F, H, W\]"):
        asyncio.run(rft.cfhw_video_score("d", torch.from_numpy(video).permute(0, 3, 1, 2), "g", {}))  # frames-first
    with pytest.raises(TypeError, match="uint8 torch tensor"):
        asyncio.run(rft.cfhw_video_score("d", video, "g", {}))


def _manager_sample(pixels):
    manager = _manager(
        {
            "custom_reward_function": {
                "path": TEST_REWARDS,
                "name": "http_client_signature",
                "reward_kwargs": {"server_url": "x"},
            }
        }
    )
    return manager, _sample(pixels)


def test_reward_manager_passes_a_tensor_through_to_an_upstream_signature():
    img = noise(3)
    manager, sample = _manager_sample(to_solution_image(img))
    out = asyncio.run(manager.score(sample))
    assert out.ok, out.error
    assert out.score == pytest.approx(img[..., 0].mean() / 255)


def test_reward_manager_gives_numpy_pixels_to_functions_as_chw_tensors():
    img = noise(3)
    manager, sample = _manager_sample(img)  # what the diffusion policy produces: uint8 (H, W, 3)
    out = asyncio.run(manager.score(sample))
    assert out.ok, out.error
    assert out.score == pytest.approx(img[..., 0].mean() / 255)


# ----------------------------------------------------------------------- our scorers accept every form alike


def test_jpeg_and_simulated_scores_equal_for_numpy_tensor_and_pil():
    img, video = noise(4), noise(5, (3, 24, 32, 3))
    forms = [img, to_solution_image(img), Image.fromarray(img)]
    assert len({jpeg.compute_score("d", f) for f in forms}) == 1
    assert len({jpeg.compute_score_incompressibility("d", f) for f in forms}) == 1
    assert jpeg.compute_score("d", img) == pytest.approx(-jpeg_kb_of(img))
    vforms = [video, to_solution_image(video), list(video)]
    assert len({jpeg.jpeg_kb(f) for f in vforms}) == 1
    assert jpeg.jpeg_kb(video) == pytest.approx(np.mean([jpeg_kb_of(f) for f in video]))

    async def sim(f):
        return await simulated.compute_score("d", f, latency_scale=1e-4, seed=7)

    outs = [asyncio.run(sim(f)) for f in forms]
    assert all(o == outs[0] for o in outs[1:])  # same score and the same simulated latency


def test_ocr_scores_equal_for_numpy_and_tensor(no_network):
    img = text_image("HELLO 42")
    a = ocr.compute_score("ocr", img, "HELLO 42")
    b = ocr.compute_score("ocr", to_solution_image(img), "HELLO 42")
    assert a == b and a["score"] > 0.8
    video = np.stack([img, text_image("OPEN"), img])
    va = ocr.compute_score("ocr", video, "HELLO 42", frame_interval=2)
    vb = ocr.compute_score("ocr", to_solution_image(video), "HELLO 42", frame_interval=2)
    assert va == vb and va["ocr_text"].count("|") == 1  # frames 0 and 2


def test_vlm_judge_sees_the_same_frames_for_numpy_and_tensor(monkeypatch):
    seen: list[list[bytes]] = []

    class FakeJudge:
        def transcribe(self, image):
            assert isinstance(image, Image.Image) and image.mode == "RGB"
            seen[-1].append(np.asarray(image).tobytes())
            return "HELLO"

    monkeypatch.setattr(vlm_judge, "transformers_judge", lambda *a: FakeJudge())
    video = noise(6, (4, 16, 16, 3))
    results = []
    for form in (video, to_solution_image(video)):
        seen.append([])
        results.append(
            asyncio.run(vlm_judge.compute_score("d", form, "HELLO", frame_interval=2, judge_model_path="tiny:qwen2_vl"))
        )
    assert results[0] == results[1] and results[0]["score"] == 1.0
    assert seen[0] == seen[1] == [video[0].tobytes(), video[2].tobytes()]


# --------------------------------------------------------------------------------------- default dispatch


def test_default_compute_score_text_goes_to_verls_builtin(monkeypatch):
    assert default_compute_score("openai/gsm8k", solution_str="so #### 42", ground_truth="42") == 1.0
    assert default_compute_score("openai/gsm8k", solution_str="so #### 41", ground_truth="42") == 0.0
    from verl.utils import reward_score

    calls = []
    monkeypatch.setattr(reward_score, "default_compute_score", lambda *a, **k: calls.append((a, k)) or 0.5)
    assert default_compute_score("openai/gsm8k", solution_str="x", ground_truth="1", extra_info={"i": 1}) == 0.5
    assert calls == [(("openai/gsm8k", "x", "1", {"i": 1}), {})]


def test_default_compute_score_ocr_and_jpeg_sources(no_network):
    img = text_image("SALE")
    for source in ("ocr", "flow_grpo/ocr"):
        out = default_compute_score(source, solution_image=to_solution_image(img), ground_truth="SALE")
        assert out == ocr.compute_score(source, img, "SALE") and out["score"] > 0.8
    noisy = noise(8)
    got = default_compute_score("jpeg_compressibility", solution_image=to_solution_image(noisy))
    assert got == pytest.approx(-jpeg_kb_of(noisy) / 500)
    assert got == pytest.approx(_load(VERL_OMNI_JPEG, "compute_score")(to_solution_image(noisy)))


def test_default_compute_score_unknown_source_names_it_the_known_ones_and_the_fix():
    with pytest.raises(UnknownDataSourceError) as e:
        default_compute_score("my/aesthetics", solution_image=to_solution_image(noise(0)), ground_truth="")
    msg = str(e.value)
    assert "'my/aesthetics'" in msg and "flow_grpo/ocr" in msg and "jpeg_compressibility" in msg
    assert "reward.custom_reward_function.path" in msg
    with pytest.raises(UnknownDataSourceError) as e:
        default_compute_score("my/text_task", solution_str="hi", ground_truth="x")
    assert "'my/text_task'" in str(e.value) and "openai/gsm8k" in str(e.value)
    assert "reward.custom_reward_function.path" in str(e.value)
    with pytest.raises(UnknownDataSourceError, match="image reward, but this sample is text"):
        default_compute_score("ocr", solution_str="hi", ground_truth="x")
    assert isinstance(e.value, NotImplementedError)  # what verl raises, for callers that catch it


# -------------------------------------------------------------------------------- check_reward_function


def test_check_reward_function_loads_every_path_form(tmp_path, monkeypatch):
    assert check_reward_function("pkg://omni_async.reward.scorers.jpeg", "compute_score") is jpeg.compute_score
    assert check_reward_function("pkg://omni_async/reward/scorers/ocr", "compute_score") is ocr.compute_score
    assert check_reward_function(TEST_REWARDS, "Flaky").__name__ == "Flaky"
    assert check_reward_function("file://" + TEST_REWARDS, "slow_logged").__name__ == "slow_logged"
    monkeypatch.chdir(Path(TEST_REWARDS).parent)
    assert callable(check_reward_function("rewards_for_tests.py", "cfhw_video_score"))
    assert check_reward_function(None, None) is default_compute_score  # no path: dispatch by data_source
    assert check_reward_function("", "compute_score") is default_compute_score


def test_check_reward_function_missing_file_names_key_and_path(tmp_path):
    missing = str(tmp_path / "nope" / "reward.py")
    with pytest.raises(RewardConfigError) as e:
        check_reward_function(missing, "compute_score", "reward.custom_reward_function.path")
    msg = str(e.value)
    assert msg.startswith("reward.custom_reward_function.path=") and missing in msg and "file not found" in msg
    with pytest.raises(RewardConfigError, match=r"reward\.reward_functions\.ocr\.path=.*is a directory"):
        check_reward_function(str(tmp_path), "compute_score", "reward.reward_functions.ocr")


def test_check_reward_function_missing_module_and_broken_dependency(tmp_path, monkeypatch):
    with pytest.raises(RewardConfigError) as e:
        check_reward_function("pkg://omni_async.reward.scorers.nope", "compute_score")
    msg = str(e.value)
    assert "reward.custom_reward_function.path='pkg://omni_async.reward.scorers.nope'" in msg
    assert "no module 'omni_async.reward.scorers.nope'" in msg
    with pytest.raises(RewardConfigError, match="pkg:// takes a dotted module name"):
        check_reward_function("pkg://omni_async/reward/scorers/jpeg.py", "compute_score")
    (tmp_path / "needs_dep.py").write_text("import not_installed_dep_xyz\ndef compute_score(**kw):\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardConfigError, match="exists but importing it failed.*not_installed_dep_xyz"):
        check_reward_function("pkg://needs_dep", "compute_score")
    with pytest.raises(RewardConfigError, match="loading the file failed.*not_installed_dep_xyz"):
        check_reward_function(str(tmp_path / "needs_dep.py"), "compute_score")


def test_check_reward_function_missing_name_lists_what_exists():
    with pytest.raises(RewardConfigError) as e:
        check_reward_function(TEST_REWARDS, "cfhw_video", "reward.reward_functions.video")
    msg = str(e.value)
    assert msg.startswith("reward.reward_functions.video.name='cfhw_video'") and TEST_REWARDS in msg
    for name in ("Flaky", "slow_logged", "cfhw_video_score", "http_client_signature"):
        assert name in msg
    assert "did you mean 'cfhw_video_score'" in msg
    assert "zlib" not in msg and "to_pixels" not in msg  # only what the module defines
    with pytest.raises(RewardConfigError) as e:
        check_reward_function("pkg://omni_async.reward.scorers.jpeg", "compute")
    assert "compute_score, compute_score_incompressibility" in str(e.value)
    with pytest.raises(RewardConfigError, match="LOG in .* is a NoneType, not a function"):
        check_reward_function(TEST_REWARDS, "LOG")
    with pytest.raises(RewardConfigError, match=r"reward\.custom_reward_function\.name is empty"):
        check_reward_function(TEST_REWARDS, "")


def test_check_reward_function_class_and_signature(tmp_path):
    mod = tmp_path / "r.py"
    mod.write_text(
        "class NoScore:\n    pass\n"
        "class Scorer:\n    def __init__(self, url):\n        self.url = url\n"
        "    def compute_score(self, data_source, solution_image, ground_truth, extra_info):\n        return 1.0\n"
        "def strict(data_source, solution_image, ground_truth):\n    return 1.0\n"
    )
    with pytest.raises(RewardConfigError, match="class NoScore .* has no compute_score"):
        check_reward_function(str(mod), "NoScore")
    assert check_reward_function(str(mod), "Scorer", reward_kwargs={"url": "u"}, modality="image").__name__ == "Scorer"
    with pytest.raises(RewardConfigError, match=r"class Scorer.*cannot be called with \['uri'\]"):
        check_reward_function(str(mod), "Scorer", reward_kwargs={"uri": "u"}, modality="image")
    with pytest.raises(RewardConfigError, match="Scorer.compute_score.*solution_str"):
        check_reward_function(str(mod), "Scorer", reward_kwargs={"url": "u"}, modality="text")
    with pytest.raises(RewardConfigError, match="strict.*extra_info"):
        check_reward_function(str(mod), "strict", modality="image")
    # verl-omni's HTTP client signature (no data_source / extra_info, **kwargs) and a verl built-in both bind.
    check_reward_function(TEST_REWARDS, "http_client_signature", reward_kwargs={"server_url": "u"}, modality="image")
    check_reward_function("pkg://omni_async.reward.contract", "default_compute_score", modality="text")
    assert contract.check_reward_function is check_reward_function


def test_http_scorer_client_encodes_the_tensor_form_reward_functions_receive():
    """The shipped HTTP client gets verl-omni's (C, H, W) / (C, F, H, W) tensors from the manager; it must send the
    same image as for the channels-last array (the soak benchmark found it failing on every sample)."""
    from omni_async.reward.scorers.http import HttpScorer, encode_image

    img = noise(3)
    assert encode_image(to_solution_image(img)) == encode_image(img)
    client = HttpScorer("http://127.0.0.1:9")
    assert client._image_json(to_solution_image(img)) == client._image_json(img)
    video = np.stack([img, img[::-1]])
    assert client._image_json(to_solution_image(video)) == client._image_json(video)


def test_latent_output_hands_the_reward_the_clean_latent_and_prompt_encodings_and_pt_is_unchanged():
    """verl-omni's SD3 ``output_type`` (its DRM recipe), tiny:sd3 at 32x32 with bf16 weights sampling in fp32
    (``rollout.dtype``): ``latent`` hands the reward the clean latent as ``solution_image`` (fp32 ``[C, H/8, W/8]``, the
    pipeline's latent layout: SD3.5's C is 16, tiny:sd3's 4) and the rollout's ``prompt_embeds`` ``[L, D]`` / ``pooled_prompt_embeds`` ``[D]`` in
    ``extra_info``; ``both`` the uint8 pixels and ``extra_info["latents_clean"]`` too; ``pt`` the pixels alone. Through
    a pickle (what Ray sends) and verl's one-row chunk alike; verl-omni's DRM client's stand-in scores the very
    tensors the rollout made. The fp32 rollout leaves the bf16 weights bit for bit as they were."""
    import dataclasses
    import pickle

    from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig
    from omni_async.reward.worker import proto_to_sample, sample_to_proto
    from omni_async.sample import EXTRA_TENSORS, PromptRow, Sample

    drm = Path(__file__).parents[1] / "config/verl_omni_drm_stand_in.py"
    sampling = SamplingConfig(height=32, width=32, num_inference_steps=2, rollout_dtype="float32")
    policy = DiffusionPolicy("tiny:sd3", sampling, dtype=torch.bfloat16, lora_rank=2, lora_alpha=4)
    weights = {k: v.clone() for k, v in policy.trainable.state_dict().items()}
    seen = {"seen": {"path": TEST_REWARDS, "name": "latent_contract"}}
    drm = {"drm": {"path": str(drm), "name": "compute_score", "server_url": "unused", "noise_seed": 3}}
    managers = {"pt": _manager({"reward_functions": seen}), "latent": _manager({"reward_functions": {**seen, **drm}})}
    row = PromptRow("a red cube", "drm", None)
    (generated,) = policy.generate([row.prompt], [7], sampling={"output_type": "latent"})
    assert generated.output_type == "latent" and generated.latents_clean.dtype == torch.float32
    got = {}
    for output_type in ("latent", "both", "pt"):  # one rollout, handed over as each output_type hands it
        result = dataclasses.replace(generated, output_type=output_type)
        sample = Sample(0, "u", row, 7, result=result)
        record = pickle.loads(pickle.dumps(sample.reward_input()))
        for form in (record, proto_to_sample(sample_to_proto(record))):
            out = asyncio.run(managers["pt" if output_type == "pt" else "latent"].score(form))
            assert out.ok, out.error
            got[output_type] = out.extra
        assert (EXTRA_TENSORS in record) == (output_type != "pt")  # pt's record is as it was: pixels only
        if output_type != "pt":
            embeds = {k: v.float() for k, v in result.conditioning.items()}
            # the stand-in's score is a function of the latent and the pooled embedding as the rollout made them
            x_u = 0.6 * result.latents_clean[None] + 0.4 * torch.randn(
                (1, *result.latents_clean.shape), generator=torch.Generator().manual_seed(3)
            )
            raw = float(-x_u.pow(2).mean() + 0.01 * embeds["pooled_prompt_embeds"].mean())
            assert out.parts["drm"] == pytest.approx(raw, rel=1e-5)
    assert policy.compute_dtype == torch.bfloat16
    assert all(torch.equal(v, weights[k]) for k, v in policy.trainable.state_dict().items())  # same bits
    (length, dim) = result.conditioning["prompt_embeds"].shape
    pooled = result.conditioning["pooled_prompt_embeds"].shape[0]
    embeds = {"prompt_embeds": f"bfloat16 [{length}, {dim}]", "pooled_prompt_embeds": f"bfloat16 [{pooled}]"}
    assert got["latent"]["solution"] == "float32 [4, 4, 4]" and got["latent"]["tensors"] == embeds
    assert got["both"]["solution"] == "uint8 [3, 32, 32]"
    assert got["both"]["tensors"] == {**embeds, "latents_clean": "float32 [4, 4, 4]"}
    assert got["pt"]["solution"] == "uint8 [3, 32, 32]" and got["pt"]["tensors"] == {}
