"""VLM judge (transformers in a real reward worker; openai against a real local server) and the HTTP scorer client
(against the real scorer server and a misbehaving one), all on loopback."""

from __future__ import annotations

import asyncio
import email.utils
import gc
import math
import re
import socket
import sys
import time

import httpx
import numpy as np
import pytest
import ray
from helpers import record_client_sleeps
from judge_test_servers import Control, ThreadServer, make_app
from omegaconf import OmegaConf
from PIL import Image, ImageDraw, ImageFont

from omni_async.cluster import init_ray, shutdown_ray
from omni_async.reward import http_client
from omni_async.reward.http_client import RetryTally, RewardHTTPError, retry_after_seconds
from omni_async.reward.scorers import jpeg, vlm_judge
from omni_async.reward.scorers.http import HttpScorer
from omni_async.reward.scorers.ocr import ocr_similarity
from omni_async.reward.vllm_server import judge_placement_group, launch_judge_servers, server_command
from omni_async.reward.worker import RewardLoopWorker, sample_to_proto
from omni_async.trainer.config import ConfigError, compose, validate


def text_image(text: str) -> np.ndarray:
    img = Image.new("RGB", (128, 64), "white")
    ImageDraw.Draw(img).text((8, 16), text, fill="black", font=ImageFont.load_default(size=24))
    return np.asarray(img)


HELLO = text_image("HELLO 42")


@pytest.fixture(scope="module")
def judge():
    return vlm_judge.transformers_judge("tiny:qwen2_vl", 16, vlm_judge.DEFAULT_INSTRUCTION)


@pytest.fixture(scope="module")
def fake_servers(judge):
    control = Control()
    server = ThreadServer(make_app(control, judge))
    yield control, server
    server.stop()


def test_transformers_judge_scores_through_a_real_reward_worker(judge, no_network):
    shutdown_ray()
    init_ray(num_gpus=0, num_cpus=4)
    try:
        cfg = {
            "timeout_s": 120,
            "max_inflight_per_worker": 32,
            "reward_functions": {},
            "custom_reward_function": {
                "path": "pkg://omni_async.reward.scorers.vlm_judge",
                "name": "compute_score",
                "reward_kwargs": {"backend": "transformers", "max_new_tokens": 16},
            },
            "reward_model": {"model_path": "tiny:qwen2_vl"},
        }  # the judge model's one key
        worker = ray.remote(RewardLoopWorker).remote(cfg, 0)
        sample = {
            "prompt": 'a sign "HELLO 42"',
            "data_source": "ocr",
            "ground_truth": "HELLO 42",
            "extra_info": {},
            "uid": "0",
            "solution_image": HELLO,
        }
        out = ray.get(worker.compute_score.remote(sample_to_proto(sample)))
    finally:
        shutdown_ray()
    info = out["reward_extra_info"]
    assert info["reward_status"] == "ok", info
    # Deterministic decoding: the worker's judge said exactly what the same judge says here, and the score is
    # the OCR rule applied to that text.
    assert info["judge_text"] == judge.transcribe(Image.fromarray(HELLO))
    assert out["reward_score"] == pytest.approx(ocr_similarity(info["judge_text"], "HELLO 42"))


def test_openai_backend_against_a_real_local_server(judge, fake_servers):
    control, server = fake_servers
    control.mode, control.calls = "ok", 0
    kw = dict(backend="openai", base_url=server.url, max_new_tokens=16, backoff_s=0.01, timeout_s=2.0)
    out = asyncio.run(vlm_judge.compute_score("ocr", HELLO, "HELLO 42", {}, **kw))
    assert out["judge_text"] == judge.transcribe(Image.fromarray(HELLO))  # same judge behind HTTP

    control.mode, control.failures_left, control.calls = "fail_then_ok", 2, 0
    asyncio.run(vlm_judge.compute_score("ocr", HELLO, "HELLO 42", {}, **kw))
    assert control.calls == 3  # 503, 503, then success

    control.mode, control.calls = "bad_request", 0
    with pytest.raises(RewardHTTPError, match="HTTP 400.*not retried"):
        asyncio.run(vlm_judge.compute_score("ocr", HELLO, "HELLO 42", {}, **kw))
    assert control.calls == 1

    control.mode, control.calls = "slow", 0
    with pytest.raises(RewardHTTPError, match="Timeout"):
        asyncio.run(vlm_judge.compute_score("ocr", HELLO, "HELLO 42", {}, **{**kw, "timeout_s": 0.3, "max_retries": 1}))
    assert control.calls == 2
    control.mode = "ok"


def test_http_client_micro_batches_against_the_scorer_server(server_factory):
    server = server_factory("--scorer", "jpeg", "--max-batch", "64", "--allow-flow-grpo-pickle")
    images = [np.random.default_rng(i).integers(0, 255, (32, 32, 3), dtype=np.uint8) for i in range(20)]

    async def run(client: HttpScorer):
        return await asyncio.gather(
            *(client.compute_score("x", img, None, {"prompt": f"p{i}"}) for i, img in enumerate(images))
        )

    client = HttpScorer(server.url, max_batch=8, max_wait_ms=50)
    out = asyncio.run(run(client))
    assert [o["score"] for o in out] == pytest.approx([jpeg.compute_score("x", img) for img in images])  # PNG: exact
    metrics = httpx.get(f"{server.url}/metrics").text
    http_calls = float(re.search(r'scorer_requests_total\{route="/v1/score"\} (\S+)', metrics).group(1))
    assert http_calls <= math.ceil(20 / 8) and client.stats.calls == http_calls

    flow = HttpScorer(server.url, protocol="flow_grpo", max_batch=8, max_wait_ms=50)
    assert all(np.isfinite(o["score"]) for o in asyncio.run(run(flow)))


def test_http_client_sends_no_batch_early_after_a_full_one(monkeypatch):
    """A batch sent because it was full leaves no timer behind: the next sample waits its own ``max_wait_ms`` for
    company. (A stale timer of the full batch's first sample used to send the next sample alone, 0.2 s after it
    arrived, and the one after it alone too.)"""
    sizes: list[int] = []

    async def send(self, batch):
        sizes.append(len(batch))
        for it in batch:
            it.future.set_result((0.0, {}, RetryTally()))

    monkeypatch.setattr(HttpScorer, "_send", send)
    client = HttpScorer("http://127.0.0.1:9", max_batch=2, max_wait_ms=1000)
    img = np.zeros((8, 8, 3), np.uint8)

    async def at(delay_s: float):
        await asyncio.sleep(delay_s)
        return await client.compute_score("x", img)

    async def run():
        # 0 s: two samples, a full batch. 0.8 s: a third, due at 1.8 s. 1.4 s: a fourth joins it (a stale timer of
        # the first batch would have fired at 1.0 s, between them).
        await asyncio.gather(at(0.0), at(0.0), at(0.8), at(1.4))

    asyncio.run(run())
    assert sizes == [2, 2]


def test_http_client_retry_policy_and_malicious_pickle(fake_servers, tmp_path):
    control, server = fake_servers
    img = np.zeros((16, 16, 3), np.uint8)
    call = lambda client: asyncio.run(client.compute_score("x", img, "gt", {}))  # noqa: E731

    control.mode, control.failures_left, control.calls = "fail_then_ok", 2, 0
    client = HttpScorer([server.url], backoff_s=0.01, max_wait_ms=1)
    out = call(client)
    assert out["score"] == 0.5 and client.stats.retries == 2 and control.calls == 3
    assert out["http_retries"] == 2 and out["http_timeouts"] == 0  # per sample, for reward/http_retries

    control.mode, control.calls = "bad_request", 0
    with pytest.raises(RewardHTTPError, match="400"):
        call(HttpScorer(server.url, backoff_s=0.01, max_wait_ms=1))
    assert control.calls == 1

    control.mode, control.calls = "error_body", 0
    with pytest.raises(RewardHTTPError, match="scorer crashed"):
        call(HttpScorer(server.url, backoff_s=0.01, max_wait_ms=1))
    assert control.calls == 1  # an error inside a 200 body is not retried

    marker = tmp_path / "pwned"
    control.mode, control.gadget_target = "gadget", str(marker)
    with pytest.raises(RewardHTTPError, match="refused"):
        call(HttpScorer(server.url, protocol="flow_grpo", max_wait_ms=1))
    assert not marker.exists()
    control.mode = "ok"


def test_http_client_honours_retry_after_and_counts_retries_and_timeouts(fake_servers, monkeypatch):
    control, server = fake_servers
    img = np.zeros((16, 16, 3), np.uint8)
    # What the client sleeps between attempts (not waited here: the fake server's answers do not depend on time).
    slept = record_client_sleeps(monkeypatch, wait=False)

    def call(**kw):
        slept.clear()
        return asyncio.run(HttpScorer(server.url, backoff_s=0.01, max_wait_ms=1, **kw).compute_score("x", img, "gt"))

    control.mode, control.failures_left, control.retry_after, control.calls = "busy_then_ok", 2, "1", 0
    out = call()
    assert out["score"] == 0.5 and out["http_retries"] == 2 and out["http_timeouts"] == 0 and control.calls == 3
    # The server's Retry-After, twice, plus at most the 10 ms jitter (the client's own backoff alone: <= 10 ms).
    assert len(slept) == 2 and all(1.0 <= d <= 1.01 for d in slept), slept

    control.mode, control.failures_left, control.retry_after, control.calls = "busy_then_ok", 1, "3600", 0
    out = call(max_retry_after_s=0.2)
    assert out["http_retries"] == 1 and len(slept) == 1 and 0.2 <= slept[0] <= 0.21, slept  # capped, not 3600

    control.mode, control.failures_left, control.calls = "slow_then_ok", 1, 0
    out = call(timeout_s=0.5)
    assert out["score"] == 0.5 and out["http_timeouts"] == 1 and out["http_retries"] == 1 and control.calls == 2
    control.mode = "ok"

    assert retry_after_seconds("7") == 7.0 and retry_after_seconds(None) is None
    assert retry_after_seconds("soon") is None
    # An HTTP date is read against the clock: pinned here, so the answer is exact.
    now = 1_700_000_000.0

    class PinnedTime:
        def __getattr__(self, name: str):
            return getattr(time, name)

        def time(self) -> float:
            return now

    monkeypatch.setattr(http_client, "time", PinnedTime())
    assert retry_after_seconds(email.utils.formatdate(now + 10, usegmt=True)) == 10.0
    assert retry_after_seconds(email.utils.formatdate(now - 10, usegmt=True)) == 0.0  # a date past: no wait


def test_unreachable_scorer_error_names_the_url():
    # A port this test holds bound but never listens on: connections to it are refused, and no other process can
    # start listening there meanwhile (as it could on a port closed after picking it).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        client = HttpScorer(url, max_retries=1, backoff_s=0.01, max_wait_ms=1)
        with pytest.raises(RewardHTTPError, match=re.escape(f"{url}/v1/score")) as err:
            asyncio.run(client.compute_score("x", np.zeros((8, 8, 3), np.uint8), "gt"))
    assert "ConnectError" in str(err.value) and "failed after 2 attempts" in str(err.value)


HEALTH_ONLY_VLLM = """import argparse, http.server, json, os
ap = argparse.ArgumentParser()
ap.add_argument("--host")
ap.add_argument("--port", type=int)
args, _ = ap.parse_known_args()
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}).encode()
        self.send_response(200 if self.path in ("/health", "/env") else 404)
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer((args.host, args.port), Handler).serve_forever()
"""


def health_only_vllm_python(root) -> str:
    """A python whose ``vllm.entrypoints.openai.api_server`` only answers ``/health`` (and ``/env``: the devices it
    was given): enough of a judge server to start, be found healthy and be stopped."""
    pkg = root / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (root / "vllm", root / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(HEALTH_ONLY_VLLM)
    wrapper = root / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{root}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.mark.slow  # a GPU-recipe trainer start: not in the fast tier (pytest -m 'not slow')
def test_full_gpu_recipe_config_composes_and_vllm_judges_get_tp_bundles(tmp_path):
    recipe = [
        "data.train_files=x.jsonl",
        "actor_rollout_ref.model.path=/models/Qwen-Image",
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.rollout.agent.num_workers=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "reward.reward_model.enable=True",
        "reward.reward_model.model_path=/models/Qwen2.5-VL-7B-Instruct",
        "reward.reward_model.enable_resource_pool=True",
        "reward.reward_model.n_gpus_per_node=1",
        "reward.reward_model.rollout.name=vllm",
        "reward.reward_model.rollout.server_python=/opt/vllm/bin/python",
        "reward.custom_reward_function.path=pkg://omni_async.reward.scorers.vlm_judge",
    ]
    cfg = validate(compose(recipe))
    rollout = OmegaConf.to_container(cfg.reward.reward_model.rollout)
    cmd = server_command(rollout, cfg.reward.reward_model.model_path, 8000)
    assert cmd[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "1" and "/models/Qwen2.5-VL-7B-Instruct" in cmd
    with pytest.raises(ConfigError, match="must fit on one node"):
        validate(
            compose(
                recipe + ["reward.reward_model.rollout.tensor_model_parallel_size=2", "reward.reward_model.nnodes=2"]
            )
        )  # 2 devices, but one per node
    with pytest.raises(ConfigError, match="enable_resource_pool=True"):
        validate(compose(recipe + ["reward.reward_model.enable_resource_pool=False"]))

    # TP=2 on a 2-device reward pool: one bundle of 2 (logical) devices, one server actor on it. This
    # environment has no vLLM (it cannot live next to verl): the server actor says so and how to fix it.
    tp2 = validate(
        compose(
            recipe
            + [
                "reward.reward_model.rollout.tensor_model_parallel_size=2",
                "reward.reward_model.n_gpus_per_node=2",
                f"reward.reward_model.rollout.server_python={sys.executable}",
            ]
        )
    )
    shutdown_ray()
    init_ray(num_gpus=2, num_cpus=4)
    try:
        pg = judge_placement_group(tp2.reward)
        assert pg.bundle_count == 1 and ray.util.placement_group_table(pg)["bundles"][0]["GPU"] == 2.0
        with pytest.raises(Exception, match="cannot import vllm.*server_python"):
            launch_judge_servers(tp2.reward, pg)

        # With a server that starts, the servers outlive the call that launched them (Ray ends an actor whose
        # handles are all gone, and its server with it), hold the bundle's 2 devices, and stop when told to.
        tp2.reward.reward_model.rollout.server_python = health_only_vllm_python(tmp_path)
        servers = launch_judge_servers(tp2.reward, pg)
        gc.collect()
        time.sleep(1.0)
        (url,) = servers.urls
        env = httpx.get(f"{url}/env", timeout=30).json()
        assert len(env["CUDA_VISIBLE_DEVICES"].split(",")) == 2
        servers.stop()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=5)
    finally:
        shutdown_ray()


class _Reads:
    """A stand-in judge model that transcribes every image as one fixed text (the server speaks the real API)."""

    def __init__(self, text: str):
        self.text = text

    def transcribe(self, image) -> str:
        return self.text


def test_verl_omni_genrm_reward_gets_the_judge_server_as_router_address():
    """verl-omni's GenRM rewards take ``reward_router_address`` (host:port) and ``model_name``: the manager hands
    them the run's judge server (each reward worker starts at its own server) and reward.reward_model.model_path;
    without a server the function is refused at start naming the keys."""
    from pathlib import Path

    TEST_REWARDS = str(Path(__file__).with_name("rewards_for_tests.py"))
    servers = [ThreadServer(make_app(Control(), _Reads("HELLO 42"))), ThreadServer(make_app(Control(), _Reads("HELL")))]
    try:
        cfg = {
            "timeout_s": 30,
            "max_inflight_per_worker": 4,
            "reward_functions": {},
            "custom_reward_function": {"path": TEST_REWARDS, "name": "genrm_ocr_style", "reward_kwargs": {}},
            "reward_model": {"model_path": "/models/Qwen2.5-VL-7B-Instruct"},
        }
        sample = {
            "prompt": "p",
            "data_source": "ocr",
            "ground_truth": "HELLO 42",
            "extra_info": {},
            "uid": "0",
            "solution_image": HELLO,
        }
        urls = [s.url for s in servers]
        first = asyncio.run(RewardLoopWorker(cfg, 0, urls).compute_score(sample_to_proto(sample)))
        second = asyncio.run(RewardLoopWorker(cfg, 1, urls).compute_score(sample_to_proto(sample)))
    finally:
        for s in servers:
            s.stop()
    info = first["reward_extra_info"]
    assert info["router"] == f"127.0.0.1:{servers[0].port}" and info["model"] == "/models/Qwen2.5-VL-7B-Instruct"
    assert first["reward_score"] == 1.0 and info["genrm_response"] == "HELLO 42"
    assert second["reward_extra_info"]["router"] == f"127.0.0.1:{servers[1].port}"  # worker 1 → server 1
    assert second["reward_score"] == pytest.approx(1 - 3 / 7)  # "hell" vs "hello42"

    with pytest.raises(ValueError, match="reward_router_address.*reward.reward_model.rollout.name=vllm"):
        RewardLoopWorker(cfg, 0, [])
    given = {
        **cfg,
        "custom_reward_function": {
            **cfg["custom_reward_function"],
            "reward_kwargs": {"reward_router_address": "10.0.0.1:8000"},
        },
    }
    with pytest.raises(ValueError, match="reward_kwargs.reward_router_address=10.0.0.1:8000.*Fix: drop"):
        RewardLoopWorker(given, 0, urls)
