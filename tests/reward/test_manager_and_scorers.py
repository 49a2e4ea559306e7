"""Reward manager semantics and the rule / OCR scorers, without Ray."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from omegaconf import OmegaConf
from PIL import Image, ImageDraw, ImageFont

from omni_async.reward.manager import RewardFunctionError, RewardManager, normalize_result
from omni_async.reward.scorers import jpeg, ocr
from omni_async.reward.worker import proto_to_sample, sample_to_proto
from omni_async.sample import RewardOutcome


def reward_cfg(**over):
    base = {
        "timeout_s": 5,
        "max_inflight_per_worker": 32,
        "custom_reward_function": {
            "path": "pkg://omni_async.reward.scorers.jpeg",
            "name": "compute_score",
            "reward_kwargs": {},
        },
        "reward_functions": {},
    }
    base.update(over)
    return OmegaConf.create(base)


def text_image(text: str, size=(256, 96)) -> np.ndarray:
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).text((16, 24), text, fill="black", font=ImageFont.load_default(size=40))
    return np.asarray(img)


def sample(image, gt="", uid="u"):
    return {
        "prompt": "p",
        "data_source": "test",
        "ground_truth": gt,
        "extra_info": {},
        "uid": uid,
        "solution_image": image,
    }


def test_normalize_result_accepts_the_conventions_and_names_bad_returns():
    assert normalize_result("f", 1) == (1.0, {})
    assert normalize_result("f", {"score": 0.5, "acc": 1}) == (0.5, {"acc": 1})
    assert normalize_result("f", (0.2, "txt", "why")) == (0.2, {"judge_text": "txt", "judge_explanation": "why"})
    for bad in ("high", None, float("nan"), True, {"value": 1}, [1.0]):
        with pytest.raises(RewardFunctionError, match="reward function f"):
            normalize_result("f", bad)


def test_multi_reward_runs_concurrently_weighted_and_optional_failure_is_left_out(tmp_path):
    mod = tmp_path / "rewards.py"
    events = tmp_path / "events.txt"
    # Each call writes when it starts and when it ends; the sleep is an await point where a sequential manager would
    # run the call to its end before starting the next.
    mod.write_text(
        "import asyncio\n"
        "async def slow(data_source, solution_image, ground_truth, extra_info, value=1.0, events='', **kw):\n"
        "    with open(events, 'a') as f:\n        f.write(f'start {value}\\n')\n"
        "    await asyncio.sleep(0.05)\n"
        "    with open(events, 'a') as f:\n        f.write(f'end {value}\\n')\n"
        "    return value\n"
        "def broken(**kw):\n    raise ValueError('judge down')\n"
    )
    fns = {
        "a": {"path": str(mod), "name": "slow", "weight": 2.0, "value": 0.25, "events": str(events)},
        "b": {"path": str(mod), "name": "slow", "weight": 1.0, "value": 1.0, "events": str(events)},
        "c": {"path": str(mod), "name": "broken", "required": False},
    }
    manager = RewardManager(reward_cfg(reward_functions=fns))
    out = asyncio.run(manager.score(sample(np.zeros((8, 8, 3), np.uint8))))
    # Concurrently: both functions started before either ended (one after the other: start, end, start, end).
    order = events.read_text().split("\n")[:-1]
    assert sorted(order[:2]) == ["start 0.25", "start 1.0"] and sorted(order[2:]) == ["end 0.25", "end 1.0"], order
    assert out.ok and out.score == pytest.approx(2 * 0.25 + 1.0)
    assert out.extra["reward/a"] == 0.25 and out.extra["reward/combined"] == pytest.approx(1.5)
    assert "judge down" in out.extra["reward/c_failed"]
    fns["c"]["required"] = True
    failed = asyncio.run(RewardManager(reward_cfg(reward_functions=fns)).score(sample(np.zeros((8, 8, 3), np.uint8))))
    assert failed.status == "failed" and "broken" in failed.error and "judge down" in failed.error


def test_timeout_is_typed_and_post_process_can_repair(tmp_path):
    mod = tmp_path / "r.py"
    mod.write_text(
        "import asyncio\n"
        "class R:\n"
        "    async def compute_score(self, solution_image, **kw):\n"
        "        if solution_image[0, 0, 0] == 1:\n            await asyncio.sleep(60)\n"
        "        return float(solution_image[0, 0, 0])\n"
        "    def post_process_scores(self, scores):\n"
        "        ok = [s for s in scores if s is not None]\n"
        "        return [s if s is not None else sum(ok) / len(ok) for s in scores]\n"
    )
    manager = RewardManager(
        reward_cfg(timeout_s=0.3, custom_reward_function={"path": str(mod), "name": "R", "reward_kwargs": {}})
    )
    imgs = [np.full((4, 4, 3), v, np.uint8) for v in (2, 1, 4)]
    outcomes = manager.score_batch([sample(i) for i in imgs])  # one group: post-processed as a whole
    assert [o.status for o in outcomes] == ["ok", "ok", "ok"]
    assert [o.score for o in outcomes] == [2.0, 3.0, 4.0]
    assert outcomes[1].extra["reward/post_process_repaired"] == 1.0
    raw = asyncio.run(manager.score(sample(imgs[1])))
    assert raw.status == "timeout" and "timeout_s=0.3" in raw.error


def test_worker_wire_format_roundtrip():
    img = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)  # a 2-frame video
    back = proto_to_sample(sample_to_proto(sample(img, gt="HI", uid="3-1")))
    np.testing.assert_array_equal(back["solution_image"], img)
    assert back["ground_truth"] == "HI" and back["uid"] == "3-1"
    ok = RewardOutcome("ok", 0.5, parts={"score": 0.5}, extra={"ocr_text": "hi"}, compute_s=0.1).to_verl()
    assert ok["reward_score"] == 0.5 and ok["reward_extra_info"]["ocr_text"] == "hi"
    failed = RewardOutcome("failed", error="boom").to_verl()  # verl's form: no score, the status says why
    assert failed["reward_score"] is None and failed["reward_extra_info"]["reward_status"] == "failed"
    assert failed["reward_extra_info"]["reward_error"] == "boom"


def test_jpeg_rewards_images_and_videos():
    flat, noisy = np.full((64, 64, 3), 128, np.uint8), np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)
    assert jpeg.compute_score("x", flat) > jpeg.compute_score("x", noisy)
    assert jpeg.compute_score_incompressibility("x", noisy) == -jpeg.compute_score("x", noisy)
    video = np.stack([flat, noisy])
    assert jpeg.jpeg_kb(video) == pytest.approx((jpeg.jpeg_kb(flat) + jpeg.jpeg_kb(noisy)) / 2)
    with pytest.raises(TypeError, match="solution_image"):
        jpeg.compute_score("x", np.zeros((4, 4), np.float32))


def test_ocr_similarity_rule():
    assert ocr.ocr_similarity("Hello 42", "HELLO42") == 1.0
    assert ocr.ocr_similarity("xx hello42 yy", "hello42") == 1.0  # substring shortcut
    assert ocr.ocr_similarity("xx hello42 yy", "hello42", substring_shortcut=False) < 1.0
    assert ocr.ocr_similarity("HELL0 42", "HELLO 42") == pytest.approx(1 - 1 / 7)
    assert ocr.ocr_similarity("", "ABC") == 0.0


def test_ocr_judge_reads_rendered_text(no_network):
    out = ocr.compute_score("ocr", text_image("HELLO 42"), "HELLO 42")
    assert out["score"] > 0.8, out
    blank = ocr.compute_score("ocr", np.full((96, 256, 3), 255, np.uint8), "HELLO 42")
    assert blank["score"] == 0.0
    video = np.stack([text_image("HELLO 42"), np.full((96, 256, 3), 255, np.uint8)])
    assert ocr.compute_score("ocr", video, "HELLO 42")["score"] == pytest.approx((out["score"] + 0.0) / 2)


def test_ocr_reads_upright_text_as_written(no_network):
    """No angle classifier (as flow_grpo's PaddleOCR(use_angle_cls=False)): rapidocr's default one turns the upright
    OHIO over and reads OIHO, scoring a correct image 0.5."""
    assert ocr.read_text(text_image("OHIO")) == "OHIO"
    assert ocr.compute_score("ocr", text_image("OHIO"), "OHIO")["score"] == 1.0


def test_a_ray_worker_without_a_gpu_owns_none_though_it_sees_one(monkeypatch):
    """On a GPU machine Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for a CPU actor (the reward workers beside the
    actor saw its H200): Ray's assignment, not visibility, says which device a worker owns."""
    import ray
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    assert ocr._local_cuda_device() is None
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [3])
    assert ocr._local_cuda_device() == 0  # CUDA_VISIBLE_DEVICES points at it
    monkeypatch.setenv("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1")
    assert ocr._local_cuda_device() == 3
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # the scorer server: the visible device
    assert ocr._local_cuda_device() == 0


def test_ocr_reads_on_the_reward_workers_gpu(monkeypatch, caplog):
    """use_cuda=auto: onnxruntime's CUDA provider on the worker's GPU when it has one and the provider exists; CPU
    otherwise (a warning when a GPU then idles); true without them is an error naming the fix."""
    import onnxruntime

    cpu_only, with_cuda = ["CPUExecutionProvider"], [ocr.CUDA_EP, "CPUExecutionProvider"]
    assert ocr.ocr_device("auto") is None and ocr.ocr_device(False) is None  # this box: no CUDA device
    with pytest.raises(RuntimeError, match="no CUDA device.*enable_resource_pool"):
        ocr.ocr_device(True)
    with pytest.raises(ValueError, match="use_cuda='gpu'"):
        ocr.ocr_device("gpu")
    monkeypatch.setattr(ocr, "_local_cuda_device", lambda: 0)  # a reward worker that owns a GPU
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: with_cuda)
    assert ocr.ocr_device("auto") == 0 and ocr.ocr_device(True) == 0 and ocr.ocr_device(False) is None
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: cpu_only)  # the CPU onnxruntime wheel
    ocr._warn_idle_gpu.cache_clear()
    with caplog.at_level("WARNING"):
        assert ocr.ocr_device("auto") is None and ocr.ocr_device("auto") is None
    assert "holds GPU 0 idle" in caplog.text and "onnxruntime-gpu" in caplog.text
    assert caplog.text.count("holds GPU 0 idle") == 1  # once per process, not per read
    with pytest.raises(RuntimeError, match="onnxruntime-gpu"):
        ocr.ocr_device(True)
    # The GPU engine's settings are rapidocr's own keys: its real config parser takes them.
    from rapidocr import RapidOCR

    engine = RapidOCR(params=ocr.engine_params(0, 256))
    assert engine.cfg.EngineConfig.onnxruntime.use_cuda is True
    assert engine.cfg.EngineConfig.onnxruntime.cuda_ep_cfg.device_id == 0
    assert "EngineConfig.onnxruntime.use_cuda" not in ocr.engine_params(None, 256)


def test_judge_urls_reach_the_functions_that_take_them_and_are_refused_otherwise(tmp_path):
    mod = tmp_path / "j.py"
    mod.write_text(
        "def judged(data_source, solution_image, ground_truth, extra_info, judge_urls=None):\n"
        "    return {'score': float(len(judge_urls)), 'first': judge_urls[0]}\n"
        "def plain(data_source, solution_image, ground_truth, extra_info):\n    return 0.0\n"
    )
    urls = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    cfg = reward_cfg(custom_reward_function={"path": str(mod), "name": "judged", "reward_kwargs": {}})
    out = asyncio.run(RewardManager(cfg, judge_urls=urls).score(sample(np.zeros((4, 4, 3), np.uint8))))
    assert out.ok and out.score == 2.0 and out.extra["first"] == urls[0]
    plain = reward_cfg(custom_reward_function={"path": str(mod), "name": "plain", "reward_kwargs": {}})
    with pytest.raises(ValueError, match="judge_urls"):
        RewardManager(plain, judge_urls=urls)
