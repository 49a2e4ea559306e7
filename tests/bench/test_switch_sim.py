"""The simulated devices (``sim:text``, ``models.sim_policy``) and ``bench/switch_sim.py``: the device's contract
in-process (lengths from the seed, partial rollout, the update's waits and gradient path), the key checks, and the
switch on the long-tail workload through the real driver, rollouter, reward worker and switch policy."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from omni_async.config.model_paths import check_model_paths
from omni_async.modality import get_modality
from omni_async.models.text_policy import length_budget
from omni_async.trainer.config import ConfigError, compose

ROOT = Path(__file__).resolve().parents[2]

SAMPLING = {"response_length": 64, "temperature": 1.0, "response_length_pareto_alpha": 1.2}


def sim_policy(**timings: float):
    model = {"path": "sim:text", "lora_rank": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    return get_modality("text").build_policy({**model, "override_config": timings}, SAMPLING)


def test_sim_device_waits_instead_of_computing_and_keeps_the_rollout_contract():
    policy = sim_policy(token_s=0.001, row_token_s=0.0, prefill_s=0.0, update_token_s=0.002)
    seeds = [1, 2, 3, 4]
    full = policy.generate(["a", "b", "c", "d"], seeds)
    lengths = [length_budget(s, 64, 1.2) for s in seeds]
    assert [len(r.response_ids) for r in full] == lengths  # the seeded long-tail budget
    assert all(len(r.log_probs) == n and not r.unfinished for r, n in zip(full, lengths, strict=True))
    # one decode step per token of the longest (rows decode together), the prefill giving the first
    assert policy.busy.asked_s == pytest.approx(0.001 * (max(lengths) - 1))
    assert policy.busy.busy_s() >= policy.busy.asked_s
    # partial rollout: stopped after 3 steps, continued from its tokens: the same response as uninterrupted
    asks = iter([False] * 3 + [True] * 1000)
    cut = policy.generate(["a", "b"], seeds[:2], should_stop=lambda: next(asks))
    assert all(r.unfinished and len(r.response_ids) == 4 for r in cut)
    resumed = policy.generate(["a", "b"], seeds[:2], resume=cut)
    assert [r.response_ids for r in resumed] == [r.response_ids for r in full[:2]]
    assert [len(r.log_probs) for r in resumed] == lengths[:2]
    # the update: 2 ms per response token with gradients, a third without; log-probs 0 on the trainable weights
    mask = torch.ones(2, 10)
    before = policy.busy.asked_s
    out = policy.log_probs(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), torch.zeros(2, 10).long(), mask)
    assert policy.busy.asked_s - before == pytest.approx(0.04)
    with torch.no_grad():
        policy.log_probs(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), torch.zeros(2, 10).long(), mask)
    assert policy.busy.asked_s - before == pytest.approx(0.04 * 4 / 3)
    assert out.shape == (2, 10) and out.requires_grad and float(out.abs().sum()) == 0.0
    out.sum().backward()
    assert all(p.grad is not None for p in policy.trainable_parameters())


def test_sim_source_keys_are_checked_at_start():
    def problems(*overrides: str) -> str:
        cfg = compose(["data.train_files=x.jsonl", "actor_rollout_ref.model.path=sim:text", *overrides])
        with pytest.raises(ConfigError) as err:
            check_model_paths(cfg)
        return str(err.value)

    assert "set actor_rollout_ref.model.modality=text" in problems()  # the image config
    text = ["actor_rollout_ref.model.modality=text"]
    assert "tokens_s" in problems(*text, "++actor_rollout_ref.model.override_config.tokens_s=1")
    assert ">= 0" in problems(*text, "++actor_rollout_ref.model.override_config.token_s=-1")
    check_model_paths(compose(["data.train_files=x.jsonl", *text, "actor_rollout_ref.model.path=sim:text"]))
    cfg = compose(["data.train_files=x.jsonl", *text, "actor_rollout_ref.model.path=sim:nope"])
    with pytest.raises(ConfigError, match="unknown simulated device"):
        check_model_paths(cfg)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_switch_gains_on_the_long_tail_workload_of_simulated_devices(tmp_path):
    """``bench/switch_sim.py``'s long-tail workload, shortened: the trainer device lends a hand and the run trains
    faster (the bench's goal is 1.2x; a short run on a shared box is asserted with a margin)."""
    # Loaded by path (bench/ on sys.path would let bench/http_scorer.py shadow the http_scorer package).
    spec = importlib.util.spec_from_file_location("bench_switch_sim", ROOT / "bench/switch_sim.py")
    switch_sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(switch_sim)
    short = ("actor_rollout_ref.rollout.response_length=64",)  # the same tail, half the tokens
    result = switch_sim.measure("long_tail_text", tmp_path, warmup=1, steps=3, tail=1, staleness=2, extra=short)
    off, on = result["off"], result["on"]
    assert result["switches"] >= 1 and on["lent_samples"] >= 1 and off["switches"] == 0
    assert on["busy"]["trainer"] > off["busy"]["trainer"] + 0.2  # the lent device generated
    assert on["samples_per_s"] >= 1.1 * off["samples_per_s"]


def test_sim_image_device_waits_per_batch_and_keeps_the_rollout_contract():
    """``sim:image`` (``models.sim_image_policy``): a device batch is one wait of ``batch_s + image_s x images``, its
    samples drawn from their seeds in the rollout's layout; the update's forward waits per sample and step (a third
    without gradients) and hangs on the trainable weights."""
    model = {"path": "sim:image", "lora_rank": 8, "lora_alpha": 16, "target_modules": ["to_q", "to_v"]}
    timings = {"batch_s": 0.01, "image_s": 0.005, "update_step_s": 0.002}
    sampling = {"height": 32, "width": 32, "num_inference_steps": 4}
    policy = get_modality("image").build_policy({**model, "override_config": timings}, sampling)
    out = policy.generate(["a", "b", "c"], [1, 2, 3], range(1, 3))
    assert policy.busy.asked_s == pytest.approx(0.01 + 3 * 0.005)  # one wait for the batch
    assert all(r.window_start == 1 and r.window_latents.shape[0] == 3 and r.log_probs.tolist() == [0, 0] for r in out)
    assert out[0].pixels.shape == (32, 32, 3) and (out[0].pixels != out[1].pixels).any()
    again = policy.generate(["x"], [2], range(1, 3))[0]  # a sample is a function of its seed, not of its batch
    assert (again.pixels == out[1].pixels).all() and torch.equal(again.window_latents, out[1].window_latents)
    before = policy.busy.asked_s
    x = out[0].window_latents[None, 0].expand(2, *out[0].window_latents.shape[1:])
    step = policy.step({}, x, 1, prev_sample=x)
    assert policy.busy.asked_s - before == pytest.approx(2 * 0.002)
    assert step.log_prob.tolist() == [0, 0] and step.log_prob.requires_grad and torch.equal(step.mean, x)
    step.log_prob.sum().backward()
    assert all(p.grad is not None for p in policy.trainable_parameters())
    with torch.no_grad():
        policy.step({}, x, 1, prev_sample=x)
    assert policy.busy.asked_s - before == pytest.approx(2 * 0.002 * 4 / 3)


def test_sim_image_source_keys_are_checked_at_start():
    def problems(*overrides: str) -> str:
        cfg = compose(["data.train_files=x.jsonl", "actor_rollout_ref.model.path=sim:image", *overrides])
        with pytest.raises(ConfigError) as err:
            check_model_paths(cfg)
        return str(err.value)

    assert "set actor_rollout_ref.model.modality=image" in problems("actor_rollout_ref.model.modality=text")
    assert "batch_s, image_s, update_step_s" in problems("++actor_rollout_ref.model.override_config.token_s=1")
    check_model_paths(compose(["data.train_files=x.jsonl", "actor_rollout_ref.model.path=sim:image"]))
