"""How a worker loads a model: straight onto its device, never as a whole copy in host RAM first.

``from_pretrained(path).to(device)`` materialises the model in host memory before copying it over: 57.7 GB for
Qwen-Image in bf16, once per worker, so four workers of a node would hold 230 GB of host RAM at once. With
``low_cpu_mem_usage`` the modules are created empty (meta) and each checkpoint tensor is read into place, and with
``device_map`` that place is the device (accelerate reads the safetensors shards tensor by tensor onto it).
"""

from __future__ import annotations

import torch


def pipeline_load_kwargs(device: torch.device | str, dtype: torch.dtype) -> dict:
    """``DiffusionPipeline.from_pretrained``'s placement arguments. diffusers takes a device *type* as a pipeline's
    ``device_map`` (``"cuda"``: the current device, which ``cluster.configure_worker`` sets to the worker's own), and
    only the accelerator it detected at import (``SUPPORTED_DEVICE_MAP``); any other device loads on the CPU and the
    caller moves the pipeline."""
    from diffusers.pipelines.pipeline_utils import SUPPORTED_DEVICE_MAP

    kind = torch.device(device).type
    direct = kind != "cpu" and kind in SUPPORTED_DEVICE_MAP
    return {"dtype": dtype, "low_cpu_mem_usage": True, **({"device_map": kind} if direct else {})}


def causal_lm_load_kwargs(device: torch.device | str, dtype: torch.dtype) -> dict:
    """``AutoModelForCausalLM.from_pretrained``'s placement arguments: transformers 5 always creates the modules
    empty and takes the device itself as ``device_map``."""
    dev = torch.device(device)
    return {"dtype": dtype, **({"device_map": str(dev)} if dev.type != "cpu" else {})}
