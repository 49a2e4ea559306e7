"""The vLLM text rollout client against a vLLM-API stand-in on loopback that behaves as vLLM does where it matters:
generation_config.json defaults for omitted sampling fields, raw log-probs unless processed mode, vLLM's stop rule,
allowed --max-lora-rank values, adapter bookkeeping (see vllm_api_server.py). In-process client tests first, then
the client inside a real rollout replica (Ray actor)."""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import ray
import torch

from omni_async.agent_loop.rollout_replica import RolloutReplica
from omni_async.cluster import init_ray, shutdown_ray
from omni_async.models.text_policy import TextPolicy, TextSamplingConfig
from omni_async.models.tiny import resolve_model_path
from omni_async.models.vllm_text_policy import VLLMTextPolicy
from omni_async.reward.vllm_server import normalize_server_args, vllm_max_lora_rank
from omni_async.sample import TextResult
from omni_async.trainer.config import ConfigError, compose, validate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reward"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from judge_test_servers import ThreadServer  # noqa: E402
from vllm_api_server import make_app  # noqa: E402

LORA = {"lora_rank": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
# What Qwen2.5-Instruct ships in generation_config.json; vLLM applies it to every field a request leaves out.
QWEN_GENERATION_DEFAULTS = {"top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05, "temperature": 0.7}
PROMPTS = ["What is 2+3?", "Hi", "Name a colour.", "Count to three."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """tiny:qwen2 with Qwen's sampling defaults in its generation_config.json (EOS stays 258 = <|im_end|>; the
    tokenizer's EOS is 256 = <|endoftext|>, as with Qwen2.5 base tokenizers)."""
    out = tmp_path_factory.mktemp("qwen_like") / "model"
    shutil.copytree(resolve_model_path("tiny:qwen2"), out)
    cfg_path = out / "generation_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **QWEN_GENERATION_DEFAULTS}))
    return str(out)


def actor(model_dir: str, temperature: float = 0.7, response_length: int = 8, lora_rank: int = 4) -> TextPolicy:
    torch.manual_seed(0)
    return TextPolicy(
        model_dir,
        TextSamplingConfig(response_length=response_length, temperature=temperature),
        **{**LORA, "lora_rank": lora_rank},
    )


def client(
    model_dir: str, url: str, temperature: float = 0.7, response_length: int = 8, lora_rank: int = 4
) -> VLLMTextPolicy:
    return VLLMTextPolicy(
        model_dir,
        TextSamplingConfig(response_length=response_length, temperature=temperature),
        **{**LORA, "lora_rank": lora_rank},
        server={"server_url": url},
    )


def recompute(policy: TextPolicy, rec: TextResult) -> torch.Tensor:
    """The actor's log-probs of a sampled response (what π_old must equal)."""
    p, r = torch.tensor([rec.prompt_ids]), torch.tensor([rec.response_ids])
    with torch.no_grad():
        return policy.log_probs(p, torch.ones_like(p), r, torch.ones_like(r))[0]


def test_samples_are_the_actors_distribution_at_temperature_07(model_dir):
    """Pinned sampling fields + processed log-probs: tokens equal the actor's for the same seeds, log-probs equal
    the actor's recomputed ones. Omitting the fields (the server then applies top_k=20, top_p=0.8, ...) or reading
    raw log-probs fails this."""
    reference = actor(model_dir)
    server = ThreadServer(make_app(actor(model_dir), model_path=model_dir, logprobs_mode="processed_logprobs"))
    try:
        got = client(model_dir, server.url).generate(PROMPTS, [11, 12, 13, 14])
        want = reference.generate(PROMPTS, [11, 12, 13, 14])
        for g, w in zip(got, want, strict=True):
            assert g.prompt_ids == w.prompt_ids and g.response_ids == w.response_ids
            assert torch.allclose(g.log_probs, recompute(reference, g), atol=1e-4)

        # The stand-in does apply the generation config to what a request omits: the same request without the
        # pinned fields samples from another distribution (the log-probs of the top-k/top-p-renormalised one).
        unpinned = {
            "model": "base",
            "prompt": got[0].prompt_ids,
            "max_tokens": 8,
            "temperature": 0.7,
            "seed": 11,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        lp = httpx.post(f"{server.url}/v1/completions", json=unpinned).json()["choices"][0]["logprobs"]
        ids = [int(t.split(":")[1]) for t in lp["tokens"]]
        other = recompute(reference, TextResult(got[0].prompt_ids, ids, "", torch.zeros(len(ids))))
        assert not torch.allclose(torch.tensor(lp["token_logprobs"]), other, atol=1e-3)
    finally:
        server.stop()


def test_raw_logprob_server_is_refused_when_temperature_is_not_1(model_dir):
    server = ThreadServer(make_app(actor(model_dir), model_path=model_dir, logprobs_mode="raw_logprobs"))
    try:
        with pytest.raises(RuntimeError, match="--logprobs-mode processed_logprobs"):
            client(model_dir, server.url, temperature=0.7)
        # At temperature 1 raw and processed log-probs are the same thing: accepted, and equal to the actor's.
        rec = client(model_dir, server.url, temperature=1.0).generate(["Hi"], [5])[0]
        assert torch.allclose(rec.log_probs, recompute(actor(model_dir, temperature=1.0), rec), atol=1e-4)
    finally:
        server.stop()


def test_stop_rule_is_the_actors(model_dir):
    """vLLM also stops at the tokenizer's EOS (256); the actor stops at generation_config's EOS ids (258) only. For a
    seed whose actor response runs through a 256, the client's response must too."""
    reference = actor(model_dir, response_length=24)
    seeds = list(range(48))
    candidates = reference.generate(["Hi"] * len(seeds), seeds)
    seed = next((s for s, r in zip(seeds, candidates, strict=True) if 256 in r.response_ids[:-1]), None)
    assert seed is not None, "no seed samples <|endoftext|> mid-response; widen the search"
    want = reference.generate(["Hi"], [seed])[0]
    server = ThreadServer(make_app(actor(model_dir), model_path=model_dir, logprobs_mode="processed_logprobs"))
    try:
        got = client(model_dir, server.url, response_length=24).generate(["Hi"], [seed])[0]
        assert got.response_ids == want.response_ids
    finally:
        server.stop()


def test_batch_is_sent_concurrently_and_old_adapters_are_unloaded(model_dir):
    reference = actor(model_dir)
    app = make_app(actor(model_dir), model_path=model_dir, logprobs_mode="processed_logprobs")
    stats = app.state.stats
    server = ThreadServer(app)
    try:
        c = client(model_dir, server.url)
        c.generate(PROMPTS, [1, 2, 3, 4])
        assert stats.max_in_flight > 1, "a batch's requests must be in flight together for vLLM to batch them"

        for version in range(1, 4):
            with torch.no_grad():
                for p in reference.trainable_parameters():
                    p.add_(0.3 * torch.randn_like(p))
            c.load_weights_state_dict(reference.weights_state_dict())
            assert stats.loaded == [f"v{version}"]
            assert sorted(d.name for d in c.adapters.iterdir()) == [f"v{version}"]  # old adapter dirs removed
        assert stats.loads == 3 and stats.unloads == 2
        rec = c.generate(["Hi"], [7])[0]
        assert rec.response_ids == reference.generate(["Hi"], [7])[0].response_ids

        # A sync while a batch runs on the old adapter: the old one is unloaded only after that batch is done.
        result: dict = {}

        def run_batch():
            try:
                result["records"] = c.generate(PROMPTS * 3, list(range(12)))
            except Exception as e:  # noqa: BLE001 - reported by the assertion below
                result["error"] = e

        t = threading.Thread(target=run_batch)
        t.start()
        deadline = time.time() + 30
        while stats.in_flight == 0 and time.time() < deadline:
            time.sleep(0.002)
        c.load_weights_state_dict(reference.weights_state_dict())
        assert "v3" in stats.loaded or "records" in result  # v3 still serves the running batch
        t.join(timeout=120)
        assert "error" not in result, result.get("error")
        assert len(result["records"]) == 12
        assert stats.loaded == ["v4"]
    finally:
        server.stop()


def test_max_lora_rank_is_one_vllm_accepts(model_dir):
    assert [vllm_max_lora_rank(r, "k") for r in (1, 2, 8, 9, 48, 64, 300, 512)] == [1, 8, 8, 16, 64, 64, 320, 512]
    with pytest.raises(ValueError, match="k=513"):
        vllm_max_lora_rank(513, "k")
    assert normalize_server_args(["--max-lora-rank", 48, "--max-lora-rank=100", "--x", 3], "k") == [
        "--max-lora-rank",
        "64",
        "--max-lora-rank=128",
        "--x",
        "3",
    ]
    with pytest.raises(ValueError, match="below the LoRA rank 48"):
        normalize_server_args(["--max-lora-rank", "32"], "k", min_lora_rank=48)

    with pytest.raises(ValueError, match="max_lora_rank"):  # the stand-in refuses 48 as vLLM does
        make_app(actor(model_dir), model_path=model_dir, max_lora_rank=48)
    # An adapter above --max-lora-rank is refused when it is loaded.
    server = ThreadServer(
        make_app(
            actor(model_dir, lora_rank=16), model_path=model_dir, max_lora_rank=8, logprobs_mode="processed_logprobs"
        )
    )
    try:
        c = client(model_dir, server.url, lora_rank=16)
        with pytest.raises(RuntimeError, match="LoRA rank 16 is greater than max_lora_rank 8"):
            c.load_weights_state_dict(actor(model_dir, lora_rank=16).weights_state_dict())
    finally:
        server.stop()


def test_vllm_rollout_in_a_replica_samples_concurrently_and_hot_loads_lora(model_dir):
    model = {"path": model_dir, "modality": "text", **LORA}
    sampling = {"response_length": 8, "temperature": 0.7}
    app = make_app(actor(model_dir), model_path=model_dir, logprobs_mode="processed_logprobs")
    server = ThreadServer(app)
    shutdown_ray()
    init_ray(num_gpus=0, num_cpus=4)
    try:
        rollout_server = {
            "server_python": "unused",
            "server_url": server.url,
            "gpu_memory_utilization": 0.5,
            "server_args": [],
        }
        rep = ray.remote(RolloutReplica).remote("text", model, sampling, 4, 50.0, rollout_server)
        reference = actor(model_dir)
        out = ray.get([rep.generate.remote(p, s, None) for p, s in zip(PROMPTS, [11, 12, 13, 14], strict=True)])
        assert max(ray.get(rep.stats.remote())["batch_sizes"]) > 1
        assert app.state.stats.max_in_flight > 1  # the replica's batch reached the server together
        for got in out:
            assert torch.allclose(got.result.log_probs, recompute(reference, got.result), atol=1e-4)

        # A weight sync becomes a LoRA adapter the server loads; later samples use it; the old one is unloaded.
        for version in (1, 2):
            with torch.no_grad():
                for p in reference.trainable_parameters():
                    p.add_(0.5 * torch.randn_like(p))
            assert ray.get(rep.set_weights.remote(reference.weights_state_dict(), version)) == version
        assert app.state.stats.loaded == ["v2"]
        after = ray.get(rep.generate.remote("What is 2+3?", 11, None))
        assert after.version == 2
        assert after.result.response_ids == reference.generate(["What is 2+3?"], [11])[0].response_ids
    finally:
        shutdown_ray()
        server.stop()


def test_vllm_rollout_config_checks():
    base = ["data.train_files=x.jsonl", "actor_rollout_ref.rollout.name=vllm"]
    validate(
        compose(
            base + ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.hybrid_engine=false"],
            config_name="grpo_text_trainer",
        )
    )
    with pytest.raises(ConfigError, match="actor_rollout_ref.hybrid_engine"):  # vLLM generates in its own server
        validate(compose(base + ["actor_rollout_ref.model.lora_rank=8"], config_name="grpo_text_trainer"))
    for overrides, key in ((["actor_rollout_ref.model.lora_rank=0"], "lora_rank"), ([], "rollout.name")):
        cfg = compose(base + overrides, config_name="grpo_text_trainer" if overrides else "flowgrpo_trainer")
        try:
            validate(cfg)
        except ConfigError as e:
            assert key in str(e).split(":")[0] and "Fix:" in str(e)
        else:
            raise AssertionError(f"{overrides} should not validate")
