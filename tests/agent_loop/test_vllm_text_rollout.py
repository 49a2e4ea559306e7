"""The vLLM text rollout client against a vLLM-API stand-in on loopback that behaves as vLLM does where it matters:
generation_config.json defaults for omitted sampling fields, raw log-probs unless processed mode, vLLM's stop rule,
allowed --max-lora-rank values, adapter bookkeeping (see vllm_api_server.py). The stand-in samples with its own
sampler and RNG (vLLM's algorithm, not the actor's code), so its tokens for a seed are not the actor's: the tests
compare log-probs and distributions (actor_comparison.py), and ``test_the_comparison_fails_against_a_server_that
_disagrees`` shows those comparisons fail when the server is wrong. In-process client tests first, then the client
inside a real rollout replica (Ray actor)."""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
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
from actor_comparison import assert_drawn_from_the_actor, assert_logprobs_are_the_actors  # noqa: E402
from judge_test_servers import ThreadServer  # noqa: E402
from vllm_api_server import apply_min_p, apply_penalties, apply_top_k_top_p, exponential_race, make_app  # noqa: E402

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


def unpinned_records(url: str, prompt_rows: list[list[int]], temperature: float) -> list[TextResult]:
    """The client's requests without its pinned sampling fields: the server fills them from generation_config.json
    (top_k=20, top_p=0.8, repetition_penalty=1.05)."""
    out = []
    for i, ids in enumerate(prompt_rows):
        body = {
            "model": "base",
            "prompt": ids,
            "max_tokens": 8,
            "temperature": temperature,
            "seed": 11 + i,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        lp = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["logprobs"]
        tokens = [int(t.split(":")[1]) for t in lp["tokens"]]
        out.append(TextResult(ids, tokens, "", torch.tensor(lp["token_logprobs"])))
    return out


def test_standin_sampler_masks_and_draws_as_vllm():
    """The stand-in's own sampler steps, on a distribution small enough to check by hand."""
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    logits = probs.log()

    def kept(x: torch.Tensor) -> list[int]:
        return torch.isfinite(x).nonzero().flatten().tolist()

    assert kept(apply_top_k_top_p(logits, 2, None)) == [1, 3]
    assert kept(apply_top_k_top_p(logits, None, 0.65)) == [1, 3]  # 0.4 + 0.3 reach 0.65
    assert kept(apply_top_k_top_p(logits, None, 0.75)) == [1, 3, 4]
    assert kept(apply_top_k_top_p(logits, 4, 0.65)) == [1, 3]
    assert kept(apply_min_p(logits, 0.5)) == [1, 3]  # at least half the most likely token's 0.4
    penalised = apply_penalties(torch.tensor([2.0, -1.0, 0.5]), [0], [1, 1], 2.0, 0.5, 0.25)
    assert penalised.tolist() == [1.0, -3.0, 0.5]  # 2 / 2; -1 * 2 - 0.25 * 2 - 0.5; unseen: unchanged
    rng = np.random.default_rng(0)
    freq = np.bincount([exponential_race(probs, rng) for _ in range(4000)], minlength=5) / 4000
    assert np.abs(freq - probs.numpy()).max() < 0.03  # 4 sd of a frequency out of 4000 draws


def test_samples_are_the_actors_distribution_at_temperature_07(model_dir):
    """Pinned sampling fields + processed log-probs: the server's log-probs are the actor's recomputed ones and its
    tokens are drawn from the actor's distribution. Omitting the fields (the server then applies top_k=20, top_p=0.8,
    ...) or reading raw log-probs fails this."""
    reference = actor(model_dir)
    server = ThreadServer(make_app(actor(model_dir), model_path=model_dir, logprobs_mode="processed_logprobs"))
    try:
        c = client(model_dir, server.url)
        got = c.generate(PROMPTS, [11, 12, 13, 14])
        want = reference.generate(PROMPTS, [11, 12, 13, 14])
        assert [g.prompt_ids for g in got] == [w.prompt_ids for w in want]
        # The server draws with its own RNG: its tokens are not the actor's, so nothing below agrees by construction.
        assert [g.response_ids for g in got] != [w.response_ids for w in want]
        assert [r.response_ids for r in c.generate(PROMPTS, [11, 12, 13, 14])] == [g.response_ids for g in got]
        assert_logprobs_are_the_actors(got, reference)
        assert_drawn_from_the_actor(got, reference)

        # The stand-in does apply the generation config to what a request omits: the same requests without the
        # pinned fields sample from another distribution, and both comparisons say so.
        unpinned = unpinned_records(server.url, [g.prompt_ids for g in got], temperature=0.7)
        with pytest.raises(AssertionError, match="log-probs differ"):
            assert_logprobs_are_the_actors(unpinned, reference)
        with pytest.raises(AssertionError, match="not the actor's distribution"):
            assert_drawn_from_the_actor(unpinned, reference)
    finally:
        server.stop()


def test_raw_logprob_server_is_refused_when_temperature_is_not_1(model_dir):
    server = ThreadServer(make_app(actor(model_dir), model_path=model_dir, logprobs_mode="raw_logprobs"))
    try:
        with pytest.raises(RuntimeError, match="--logprobs-mode processed_logprobs"):
            client(model_dir, server.url, temperature=0.7)
        # At temperature 1 raw and processed log-probs are the same thing: accepted, and equal to the actor's.
        reference = actor(model_dir, temperature=1.0)
        got = client(model_dir, server.url, temperature=1.0).generate(PROMPTS, [5, 6, 7, 8])
        assert_logprobs_are_the_actors(got, reference)
        assert_drawn_from_the_actor(got, reference)
        # Raw log-probs ignore the sampling fields, so only the distribution check sees unpinned requests' top-k.
        unpinned = unpinned_records(server.url, [g.prompt_ids for g in got], temperature=1.0)
        assert_logprobs_are_the_actors(unpinned, reference)
        with pytest.raises(AssertionError, match="not the actor's distribution"):
            assert_drawn_from_the_actor(unpinned, reference)
    finally:
        server.stop()


@pytest.mark.parametrize("fault", ["bfloat16_server", "stale_weights"])
def test_the_comparison_fails_against_a_server_that_disagrees(model_dir, fault):
    """The log-prob comparison the tests above pass is not true by construction: a server whose model runs in
    bfloat16 while the actor runs in float32, or one still serving the weights before the trainer's update, returns
    log-probs that are not the actor's, and the check fails on them."""
    reference = actor(model_dir)
    if fault == "stale_weights":
        with torch.no_grad():
            for p in reference.trainable_parameters():
                p.add_(0.3 * torch.randn_like(p))
    dtype = "bfloat16" if fault == "bfloat16_server" else "auto"
    server = ThreadServer(
        make_app(actor(model_dir), model_path=model_dir, logprobs_mode="processed_logprobs", dtype=dtype)
    )
    try:
        got = client(model_dir, server.url).generate(PROMPTS, [11, 12, 13, 14])
        with pytest.raises(AssertionError, match="log-probs differ"):
            assert_logprobs_are_the_actors(got, reference)
    finally:
        server.stop()


def test_stop_rule_is_the_actors(model_dir):
    """vLLM also stops at the tokenizer's EOS (256); the actor stops at generation_config's EOS ids (258) only. A
    client response that samples a 256 goes on past it (where the server's own rule would have stopped), and every
    response ends at 258 or at the length limit, as the actor's do."""
    server = ThreadServer(make_app(actor(model_dir), model_path=model_dir, logprobs_mode="processed_logprobs"))
    try:
        c = client(model_dir, server.url, response_length=24)
        seeds = list(range(48))
        responses = c.generate(["Hi"] * len(seeds), seeds)
        for r in responses:
            assert r.response_ids[-1] == 258 or len(r.response_ids) == 24, r.response_ids
            assert 258 not in r.response_ids[:-1]
        seed, got = next(((s, r) for s, r in zip(seeds, responses, strict=True) if 256 in r.response_ids[:-1]), (0, 0))
        assert got, "no seed samples <|endoftext|> mid-response; widen the search"
        assert_logprobs_are_the_actors([got], actor(model_dir, response_length=24))
        # The same request with vLLM's default stop rule ends at that 256: the client's stop settings are what let
        # the response go on.
        body = {**c.request_body(got.prompt_ids, seed), "ignore_eos": False, "stop_token_ids": None}
        choice = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]
        stopped = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
        assert stopped == got.response_ids[: got.response_ids.index(256) + 1] and choice["finish_reason"] == "stop"
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
        # The samples are of the last adapter's weights: the actor's log-probs, not the base model's.
        recs = c.generate(PROMPTS, [7, 8, 9, 10])
        assert_logprobs_are_the_actors(recs, reference)
        with pytest.raises(AssertionError, match="log-probs differ"):
            assert_logprobs_are_the_actors(recs, actor(model_dir))

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
        assert_logprobs_are_the_actors([got.result for got in out], reference)
        assert_drawn_from_the_actor([got.result for got in out], reference)

        # A weight sync becomes a LoRA adapter the server loads; later samples use it; the old one is unloaded.
        for version in (1, 2):
            with torch.no_grad():
                for p in reference.trainable_parameters():
                    p.add_(0.5 * torch.randn_like(p))
            assert ray.get(rep.set_weights.remote(reference.weights_state_dict(), version)) == version
        assert app.state.stats.loaded == ["v2"]
        after = ray.get([rep.generate.remote(p, s, None) for p, s in zip(PROMPTS, [11, 12, 13, 14], strict=True)])
        assert {a.version for a in after} == {2}
        assert_logprobs_are_the_actors([a.result for a in after], reference)  # v2's weights, not the base model's
        with pytest.raises(AssertionError, match="log-probs differ"):
            assert_logprobs_are_the_actors([a.result for a in after], actor(model_dir))
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
