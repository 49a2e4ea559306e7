"""A stand-in for vLLM's OpenAI-compatible server (vLLM cannot be installed here), answered by the tiny model.

Same routes and payloads as vLLM (``/health``, ``/v1/completions`` with token-id prompts, seeds, ``logprobs``,
``return_tokens_as_token_ids``, ``/v1/load_lora_adapter`` with a peft adapter dir, ``/v1/unload_lora_adapter``), and
the vLLM behaviours a client has to get right, enforced rather than assumed:

- ``--max-lora-rank`` must be one of vLLM's ``MaxLoRARanks`` (``vllm/config/lora.py``): anything else ends the
  process at argument parsing (exit 2, argparse's "invalid choice"); an adapter whose ``r`` exceeds it is refused
  ("LoRA rank R is greater than max_lora_rank M."). Adapter routes exist only with
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; a name loaded twice or unloaded when absent is an error.
- A sampling field a request omits takes the model's ``generation_config.json`` value (``--generation-config
  auto``, vLLM's default; ``vllm`` ignores the file); top-k / top-p / min-p / repetition, presence and frequency
  penalties are applied as vLLM's sampler does (penalties, temperature, min-p, top-k, top-p).
- Log-probs are of the raw logits (before temperature or any processing) unless ``--logprobs-mode
  processed_logprobs``.
- Stopping: the tokenizer's EOS unless ``ignore_eos``, the ``generation_config`` EOS ids unless ``ignore_eos``, and
  the request's ``stop_token_ids``; the stop token is part of the output.
- Requests are served one at a time on the "device" (a single worker thread) but accepted concurrently;
  ``stats.max_in_flight`` is the most requests the server held at once. A request whose adapter is unloaded
  while it runs fails (a client must not unload an adapter it still uses).

Sampling draws with ``torch.multinomial`` from a ``torch.Generator(seed)`` per request, as the project's
``TextPolicy`` does, so with plain temperature sampling its tokens and processed log-probs match the actor's.

Run as ``python vllm_api_server.py --model DIR [...]`` (or as a fake ``vllm.entrypoints.openai.api_server``, see
``test_vllm_server_launch.py``), or in-process with :func:`make_app`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from safetensors.torch import load_file

# vLLM's MaxLoRARanks (vllm/config/lora.py), written out here on purpose: the client's copy is what is under test.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LOGPROBS_MODES = ("raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs")
# The generation_config.json keys vLLM turns into default sampling parameters.
GENERATION_CONFIG_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
# SamplingParams defaults when neither the request nor the generation config sets a field.
VLLM_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "max_tokens": 16,
    "ignore_eos": False,
    "stop_token_ids": None,
    "seed": None,
}


@dataclass
class Stats:
    in_flight: int = 0
    max_in_flight: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)  # the /v1/completions bodies, as sent
    loaded: list[str] = field(default_factory=list)  # adapters loaded now
    loads: int = 0
    unloads: int = 0


def error(message: str, status: int) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return JSONResponse({"object": "error", "message": message, "type": kind, "param": None, "code": status}, status)


def read_generation_config(model_path: str | None, mode: str) -> dict[str, Any]:
    if mode == "vllm" or model_path is None:
        return {}
    path = Path(model_path if mode == "auto" else mode) / "generation_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def make_app(
    policy=None,
    *,
    model_path: str | None = None,
    max_lora_rank: int = 16,
    logprobs_mode: str = "raw_logprobs",
    generation_config: str = "auto",
    enable_lora: bool = True,
    runtime_lora_updating: bool = True,
    served_model_name: str = "base",
    policy_factory=None,
) -> FastAPI:
    """``policy``: a ``TextPolicy`` whose LoRA layout the adapters match; or ``policy_factory(r, alpha, modules)``
    builds one per adapter layout (the command-line server). ``model_path``: where ``generation_config.json`` is."""
    if max_lora_rank not in MAX_LORA_RANKS:  # vLLM refuses it before serving anything
        raise ValueError(f"max_lora_rank ({max_lora_rank}) must be one of {MAX_LORA_RANKS}.")
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode {logprobs_mode!r} must be one of {LOGPROBS_MODES}")
    gen = read_generation_config(model_path, generation_config)
    defaults = {
        **VLLM_DEFAULTS,
        **{
            ("max_tokens" if k == "max_new_tokens" else k): gen[k]
            for k in GENERATION_CONFIG_KEYS
            if gen.get(k) is not None
        },
    }
    gen_eos = gen.get("eos_token_id")
    gen_eos = set() if gen_eos is None else {int(e) for e in (gen_eos if isinstance(gen_eos, list) else [gen_eos])}

    app = FastAPI()
    app.state.stats = stats = Stats()
    app.state.defaults = defaults
    device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="standin-device")
    lock = threading.Lock()
    policies: dict[tuple, Any] = {}  # LoRA layout -> policy; policy -> (its base weights, adapter now in it)
    adapters: dict[str, tuple[tuple, dict[str, torch.Tensor]]] = {}  # name -> (layout, weights)
    current: dict[int, str] = {}
    base = policy if policy is not None else policy_factory(1, 1, ["q_proj"])  # LoRA B = 0: the base model
    base_state = {id(base): base.weights_state_dict()}

    def policy_for(layout: tuple):
        if policy is not None:
            return policy
        if layout not in policies:
            policies[layout] = policy_factory(layout[0], layout[1], list(layout[2]))
            base_state[id(policies[layout])] = policies[layout].weights_state_dict()
        return policies[layout]

    @app.get("/health")
    async def health():
        return {}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": n, "object": "model"} for n in [served_model_name, *adapters]]}

    if enable_lora and runtime_lora_updating:

        @app.post("/v1/load_lora_adapter")
        async def load(request: Request):
            body = await request.json()
            name, path = body.get("lora_name"), Path(str(body.get("lora_path")))
            if not name or not body.get("lora_path"):
                return error("Both 'lora_name' and 'lora_path' must be provided.", 400)
            if name in adapters or name == served_model_name:
                return error(f"The lora adapter '{name}' has already been loaded.", 400)
            try:
                cfg = json.loads((path / "adapter_config.json").read_text())
                state = load_file(str(path / "adapter_model.safetensors"))
            except OSError as e:
                return error(f"Loading lora {name} failed: No adapter found for {path}: {e}", 404)
            if int(cfg["r"]) > max_lora_rank:
                return error(f"LoRA rank {int(cfg['r'])} is greater than max_lora_rank {max_lora_rank}.", 400)
            layout = (int(cfg["r"]), int(cfg["lora_alpha"]), tuple(cfg["target_modules"]))
            state = {k.removeprefix("base_model.model."): v for k, v in state.items()}
            for k, v in state.items():  # the tensors must have the rank the config claims
                if "lora_A" in k and v.shape[0] != layout[0] or "lora_B" in k and v.shape[1] != layout[0]:
                    return error(
                        f"Loading lora {name} failed: {k} has shape {tuple(v.shape)}, not rank {layout[0]}", 400
                    )
            with lock:
                adapters[name] = (layout, state)
                stats.loaded.append(name)
                stats.loads += 1
            return f"Success: LoRA adapter '{name}' added successfully."

        @app.post("/v1/unload_lora_adapter")
        async def unload(request: Request):
            name = (await request.json()).get("lora_name")
            with lock:
                if name not in adapters:
                    return error(f"The lora adapter '{name}' cannot be found.", 404)
                del adapters[name]
                stats.loaded.remove(name)
                stats.unloads += 1
            return f"Success: LoRA adapter '{name}' removed successfully."

    def sampling_params(body: dict[str, Any]) -> dict[str, Any]:
        p = {k: (body[k] if body.get(k) is not None else defaults[k]) for k in VLLM_DEFAULTS}
        if p["temperature"] < 0:
            raise ValueError(f"temperature must be non-negative, got {p['temperature']}.")
        if not 0.0 < p["top_p"] <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p['top_p']}.")
        if p["top_k"] < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {p['top_k']}.")
        if not 0.0 <= p["min_p"] <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {p['min_p']}.")
        if p["repetition_penalty"] <= 0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {p['repetition_penalty']}.")
        return p

    @torch.no_grad()
    def generate(name: str, prompt: list[int], p: dict[str, Any]) -> dict[str, Any]:
        if name == served_model_name:
            pol = base
            weights, key = base_state[id(base)], served_model_name
        else:
            with lock:
                if name not in adapters:
                    raise LookupError(name)
                layout, weights = adapters[name]
            pol, key = policy_for(layout), name
        if current.get(id(pol)) != key:
            pol.load_weights_state_dict(weights)
            current[id(pol)] = key
        model, tok = pol.model, pol.tok
        stop = set(p["stop_token_ids"] or [])
        if not p["ignore_eos"]:
            stop |= gen_eos | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
        gen = torch.Generator()
        gen.manual_seed(int(p["seed"]) if p["seed"] is not None else int(torch.randint(0, 2**31 - 1, ()).item()))
        temp, top_k, top_p, min_p = float(p["temperature"]), int(p["top_k"]), float(p["top_p"]), float(p["min_p"])
        ids = torch.tensor([prompt])
        mask, cur, past = torch.ones_like(ids), ids, None
        out_tokens, out_lps, finish = [], [], "length"
        for _ in range(int(p["max_tokens"])):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -cur.shape[1] :]
            out = model(input_ids=cur, attention_mask=mask, position_ids=pos, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            raw = logits.clone()
            x = logits
            if p["repetition_penalty"] != 1.0:
                seen = torch.tensor(sorted(set(prompt) | set(out_tokens)), dtype=torch.long)
                v = x[seen]
                x[seen] = torch.where(v > 0, v / p["repetition_penalty"], v * p["repetition_penalty"])
            if out_tokens and (p["presence_penalty"] or p["frequency_penalty"]):
                counts = torch.bincount(torch.tensor(out_tokens), minlength=x.shape[0]).float()
                x = x - p["frequency_penalty"] * counts - p["presence_penalty"] * (counts > 0).float()
            if temp < 1e-5:  # greedy
                logp = torch.log_softmax(x, -1)
                nxt = int(logp.argmax())
            else:
                x = x / temp
                if min_p > 0:
                    probs = torch.softmax(x, -1)
                    x = x.masked_fill(probs < min_p * probs.max(), float("-inf"))
                if 0 < top_k < x.shape[0]:
                    x = x.masked_fill(x < torch.topk(x, top_k).values[-1], float("-inf"))
                if top_p < 1.0:
                    sorted_x, order = torch.sort(x, descending=True)
                    cum = torch.softmax(sorted_x, -1).cumsum(-1)
                    drop = cum - torch.softmax(sorted_x, -1) >= top_p  # keep the smallest prefix reaching top_p
                    x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
                logp = torch.log_softmax(x, -1)
                nxt = int(torch.multinomial(logp.exp(), 1, generator=gen)[0])
            lp = {
                "raw_logprobs": torch.log_softmax(raw, -1)[nxt],
                "raw_logits": raw[nxt],
                "processed_logprobs": logp[nxt],
                "processed_logits": x[nxt],
            }[logprobs_mode]
            out_tokens.append(nxt)
            out_lps.append(float(lp))
            if nxt in stop:
                finish = "stop"
                break
            cur = torch.tensor([[nxt]])
            mask = torch.cat([mask, torch.ones((1, 1), dtype=mask.dtype)], dim=1)
        return {
            "tokens": out_tokens,
            "logprobs": out_lps,
            "finish_reason": finish,
            "text": tok.decode(out_tokens, skip_special_tokens=True),
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        stats.requests.append(body)
        stats.in_flight += 1
        stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
        try:
            name = body.get("model")
            if name != served_model_name and name not in adapters:
                return error(f"The model `{name}` does not exist.", 404)
            try:
                p = sampling_params(body)
            except ValueError as e:
                return error(str(e), 400)
            await asyncio.sleep(0.01)  # the engine's scheduling step: requests arriving meanwhile share it
            try:
                res = await asyncio.get_running_loop().run_in_executor(device, generate, name, body["prompt"], p)
            except LookupError:
                return error(f"The model `{name}` does not exist.", 404)
            if name != served_model_name and name not in adapters:
                return error(f"LoRA adapter `{name}` was unloaded while the request was running.", 500)
            want_ids = body.get("return_tokens_as_token_ids")
            tokens = [f"token_id:{t}" if want_ids else base.tok.decode([t]) for t in res["tokens"]]
            logprobs = (
                None
                if body.get("logprobs") is None
                else {"tokens": tokens, "token_logprobs": res["logprobs"], "top_logprobs": None, "text_offset": []}
            )
            return {
                "id": f"cmpl-{len(stats.requests)}",
                "object": "text_completion",
                "model": name,
                "choices": [
                    {"index": 0, "text": res["text"], "logprobs": logprobs, "finish_reason": res["finish_reason"]}
                ],
                "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(res["tokens"])},
            }
        finally:
            stats.in_flight -= 1

    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """vLLM's arguments this stand-in knows; ``--max-lora-rank`` and ``--logprobs-mode`` are choices, as in vLLM."""
    ap = argparse.ArgumentParser(prog="vllm.entrypoints.openai.api_server")
    ap.add_argument("--model", required=True)
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--enable-lora", action="store_true")
    ap.add_argument("--max-lora-rank", type=int, default=16, choices=MAX_LORA_RANKS)
    ap.add_argument("--logprobs-mode", default="raw_logprobs", choices=LOGPROBS_MODES)
    ap.add_argument("--generation-config", default="auto")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=8000)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from omni_async.models.text_policy import TextPolicy, TextSamplingConfig

    args = parse_args(argv)

    def factory(r: int, alpha: int, modules: list[str]):
        torch.manual_seed(0)
        return TextPolicy(args.model, TextSamplingConfig(), lora_rank=r, lora_alpha=alpha, target_modules=modules)

    app = make_app(
        model_path=args.model,
        max_lora_rank=args.max_lora_rank,
        logprobs_mode=args.logprobs_mode,
        generation_config=args.generation_config,
        enable_lora=args.enable_lora,
        runtime_lora_updating=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
        served_model_name=args.served_model_name or args.model,
        policy_factory=factory,
    )

    @app.get("/stats")  # the stand-in's own route, for tests of a server in another process
    async def stats():
        s = app.state.stats
        return {
            "max_in_flight": s.max_in_flight,
            "loaded": s.loaded,
            "loads": s.loads,
            "unloads": s.unloads,
            "requests": s.requests,
        }

    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
