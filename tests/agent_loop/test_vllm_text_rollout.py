"""The vLLM text rollout client in a real rollout replica (Ray actor), against a vLLM-API stand-in on loopback."""

from __future__ import annotations

import sys
from pathlib import Path

import ray
import torch

from omni_async.agent_loop.rollout_replica import RolloutReplica
from omni_async.cluster import init_ray, shutdown_ray
from omni_async.models.text_policy import TextPolicy, TextSamplingConfig
from omni_async.trainer.config import ConfigError, compose, validate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reward"))
from judge_test_servers import ThreadServer  # noqa: E402
from vllm_api_server import make_app  # noqa: E402

MODEL = {"path": "tiny:qwen2", "modality": "text", "lora_rank": 4, "lora_alpha": 8,
         "target_modules": ["q_proj", "v_proj"]}
SAMPLING = {"response_length": 8, "temperature": 1.0}


def policy() -> TextPolicy:
    torch.manual_seed(0)
    return TextPolicy("tiny:qwen2", TextSamplingConfig(**SAMPLING), lora_rank=4, lora_alpha=8,
                      target_modules=["q_proj", "v_proj"])


def test_vllm_rollout_samples_and_hot_loads_lora():
    server = ThreadServer(make_app(policy()))
    shutdown_ray()
    init_ray(num_gpus=0, num_cpus=4)
    try:
        rollout_server = {"server_python": "unused", "server_url": server.url, "gpu_memory_utilization": 0.5,
                          "server_args": []}
        rep = ray.remote(RolloutReplica).remote(MODEL, SAMPLING, 4, 5.0, rollout_server)
        reference = policy()
        out = ray.get([rep.generate.remote(p, s, (0, 0)) for p, s in [("What is 2+3?", 11), ("Hi", 12)]])
        want = reference.sample_records(["What is 2+3?", "Hi"], [11, 12])
        for got, w in zip(out, want, strict=True):
            assert got["response_ids"] == w["response_ids"] and got["prompt_ids"] == w["prompt_ids"]
            assert torch.allclose(got["log_probs"], w["log_probs"], atol=1e-5)

        # A weight sync becomes a LoRA adapter the server loads; later samples use it.
        with torch.no_grad():
            for p in reference.trainable_parameters():
                p.add_(0.5 * torch.randn_like(p))
        assert ray.get(rep.set_weights.remote(reference.weights_state_dict(), 1)) == 1
        after = ray.get(rep.generate.remote("What is 2+3?", 11, (0, 0)))
        assert after["version"] == 1
        assert after["response_ids"] == reference.sample_records(["What is 2+3?"], [11])[0]["response_ids"]
    finally:
        shutdown_ray()
        server.stop()


def test_vllm_rollout_config_checks():
    base = ["data.train_files=x.jsonl", "actor_rollout_ref.rollout.name=vllm"]
    validate(compose(base + ["actor_rollout_ref.model.lora_rank=8"], config_name="grpo_text_trainer"))
    for overrides, key in ((["actor_rollout_ref.model.lora_rank=0"], "lora_rank"), ([], "rollout.name")):
        cfg = compose(base + overrides, config_name="grpo_text_trainer" if overrides else "flowgrpo_trainer")
        try:
            validate(cfg)
        except ConfigError as e:
            assert key in str(e).split(":")[0] and "Fix:" in str(e)
        else:
            raise AssertionError(f"{overrides} should not validate")
