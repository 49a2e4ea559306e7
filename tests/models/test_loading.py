"""Workers load a model straight onto their device (``models.loading``): what a CPU can see is the loading call's
arguments. ``from_pretrained(path).to(device)`` would build the whole model in host RAM first (57.7 GB for
Qwen-Image, per worker); with ``device_map`` accelerate reads each tensor onto the device."""

from __future__ import annotations

import pytest
import torch
from diffusers import DiffusionPipeline
from transformers import AutoModelForCausalLM

from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig
from omni_async.models.text_policy import TextPolicy, TextSamplingConfig


class Loaded(Exception):
    """Raised by the spy once it saw the call: nothing is loaded onto a device this box does not have."""


def spy(calls):
    def from_pretrained(path, *args, **kwargs):
        calls.append(kwargs)
        raise Loaded

    return from_pretrained


def test_diffusion_pipeline_loads_onto_the_worker_device(monkeypatch):
    from diffusers.pipelines import pipeline_utils

    calls = []
    monkeypatch.setattr(DiffusionPipeline, "from_pretrained", spy(calls))
    # diffusers accepts the accelerator it detected at import: on a CUDA machine ["balanced", "cuda", "cpu"]
    monkeypatch.setattr(pipeline_utils, "SUPPORTED_DEVICE_MAP", ["balanced", "cuda", "cpu"])
    with pytest.raises(Loaded):
        DiffusionPolicy("tiny:sd3", SamplingConfig(), device="cuda:0", dtype=torch.bfloat16)
    # diffusers' pipeline device_map takes a device type; "cuda" is the worker's current device (configure_worker)
    assert calls == [{"dtype": torch.bfloat16, "low_cpu_mem_usage": True, "device_map": "cuda"}]
    with pytest.raises(Loaded):
        DiffusionPolicy("tiny:sd3", SamplingConfig(), device="cpu")
    assert calls[-1] == {"dtype": torch.float32, "low_cpu_mem_usage": True}  # CPU: loaded where it runs
    monkeypatch.setattr(pipeline_utils, "SUPPORTED_DEVICE_MAP", ["balanced", "cpu", "cpu"])  # no accelerator seen
    with pytest.raises(Loaded):
        DiffusionPolicy("tiny:sd3", SamplingConfig(), device="cuda:0")
    assert "device_map" not in calls[-1]  # diffusers would refuse it: loaded on the CPU, then moved


def test_causal_lm_loads_onto_the_worker_device(monkeypatch):
    calls = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy(calls))
    with pytest.raises(Loaded):
        TextPolicy("tiny:qwen2", TextSamplingConfig(), device="cuda:1", dtype=torch.bfloat16)
    assert calls == [{"dtype": torch.bfloat16, "device_map": "cuda:1"}]
