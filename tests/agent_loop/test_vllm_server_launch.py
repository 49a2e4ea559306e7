"""The vLLM server the text rollout *launches*: the command line it builds, run against the vLLM-API stand-in
installed as a fake ``vllm`` package, so vLLM's argument checks (allowed --max-lora-rank values) and modes
(raw log-probs unless --logprobs-mode processed_logprobs, generation_config defaults) apply to it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from omni_async.models.text_policy import TextPolicy, TextSamplingConfig
from omni_async.models.tiny import resolve_model_path
from omni_async.models.vllm_text_policy import VLLMTextPolicy
from omni_async.reward.vllm_server import server_command, start_vllm

HERE = Path(__file__).resolve().parent
STANDIN = HERE / "vllm_api_server.py"
sys.path.insert(0, str(HERE))
from actor_comparison import assert_drawn_from_the_actor, assert_logprobs_are_the_actors  # noqa: E402

MODULES = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """tiny:qwen2 with Qwen2.5's sampling defaults in generation_config.json."""
    out = tmp_path_factory.mktemp("qwen_like") / "model"
    shutil.copytree(resolve_model_path("tiny:qwen2"), out)
    cfg = out / "generation_config.json"
    cfg.write_text(
        json.dumps(
            {**json.loads(cfg.read_text()), "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05, "temperature": 0.7}
        )
    )
    return str(out)


@pytest.fixture(scope="module")
def vllm_python(tmp_path_factory) -> str:
    """A python whose ``vllm.entrypoints.openai.api_server`` is the stand-in."""
    root = tmp_path_factory.mktemp("fake_vllm")
    pkg = root / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (root / "vllm", root / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(
        f"import sys\nsys.path.insert(0, {str(HERE)!r})\nfrom vllm_api_server import main\nmain()\n"
    )
    wrapper = root / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{root}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_standin_refuses_a_max_lora_rank_vllm_refuses(vllm_python):
    r = subprocess.run(
        [sys.executable, str(STANDIN), "--model", "unused", "--max-lora-rank", "48"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "argument --max-lora-rank: invalid choice: 48" in r.stderr
    # Through the launcher the rollout uses, that is a start-up failure.
    with pytest.raises(RuntimeError, match="exited with code 2 during start-up"):
        start_vllm(
            [
                vllm_python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                "unused",
                "--max-lora-rank",
                "48",
                "--port",
                "9",
            ],
            "http://127.0.0.1:9",
            "k",
            startup_timeout_s=120,
        )


def test_standin_on_port_0_reports_the_port_it_bound(model_dir):
    """Run by hand or by a test, the stand-in binds ``--port 0`` itself and prints the port it got."""
    proc = subprocess.Popen(
        [sys.executable, str(STANDIN), "--model", model_dir, "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # Its stdout's first line (pytest-timeout bounds a server that never prints it).
        line = proc.stdout.readline()
        m = re.fullmatch(r"vllm_api_server listening on (http://127\.0\.0\.1:([1-9]\d*))\n", line)
        assert m, line
        for _ in range(600):  # bound before uvicorn listens on it: refused until then
            try:
                assert httpx.get(f"{m.group(1)}/health", timeout=5).status_code == 200
                break
            except httpx.ConnectError:
                assert proc.poll() is None
                time.sleep(0.1)
        else:
            raise AssertionError("the stand-in never answered /health")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_judge_server_args_rank_is_rounded():
    cmd = server_command(
        {
            "server_python": "py",
            "tensor_model_parallel_size": 1,
            "gpu_memory_utilization": 0.5,
            "server_args": ["--enable-lora", "--max-lora-rank", 48],
        },
        "m",
        8000,
    )
    assert cmd[cmd.index("--max-lora-rank") + 1] == "64"


def test_launched_rollout_server_rank_48_and_processed_logprobs(model_dir, vllm_python):
    """Rank 48 -> --max-lora-rank 64 (the stand-in would exit on 48), the rank-48 adapter loads, and at temperature
    0.7 the samples are drawn from the actor's distribution with the actor's log-probs (the stand-in is raw unless
    launched in processed mode; it samples with its own RNG, so token ids are not compared)."""
    sampling = TextSamplingConfig(response_length=8, temperature=0.7)
    c = VLLMTextPolicy(
        model_dir,
        sampling,
        lora_rank=48,
        lora_alpha=96,
        target_modules=MODULES,
        server={"server_python": vllm_python, "gpu_memory_utilization": 0.5, "server_args": []},
    )
    try:
        torch.manual_seed(0)
        reference = TextPolicy(model_dir, sampling, lora_rank=48, lora_alpha=96, target_modules=MODULES)
        with torch.no_grad():
            for p in reference.trainable_parameters():
                p.add_(0.3 * torch.randn_like(p))
        c.load_weights_state_dict(reference.weights_state_dict())
        got = c.generate(["What is 2+3?", "Hi", "Name a colour.", "Count to three."], [3, 4, 5, 6])
        assert_logprobs_are_the_actors(got, reference)
        assert_drawn_from_the_actor(got, reference)
        assert httpx.get(f"{c.url}/stats").json()["loaded"] == ["v1"]
    finally:
        c.proc.terminate()
        c.proc.wait(timeout=30)
