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

The sampler is the server's own, not the actor's, so a test comparing the two compares two implementations, as
against a real vLLM server: it follows vLLM v1's ``Sampler`` (``vllm/v1/sample/sampler.py`` and
``ops/topk_topp_sampler.py``): logits cast to float32, raw log-probs taken before any processing, then penalties,
temperature, min-p, vLLM's sort-based top-k / top-p mask, processed log-probs of what is left, and a draw by the
exponential race ``argmax(probs / q)``. The ``q`` come from the stand-in's own RNG (numpy's PCG64 seeded with the
request's ``seed``; an unseeded request draws from the engine's RNG, seeded by ``--seed``), so the stand-in's
tokens for a seed are not the actor's (``torch.multinomial`` on a ``torch.Generator(seed)``): tests can compare
log-probs and distributions, not token ids. ``dtype`` (``--dtype``) is the precision the model runs in (``auto``:
the checkpoint's), as vLLM's flag.

Run as ``python vllm_api_server.py --model DIR [...]`` (or as a fake ``vllm.entrypoints.openai.api_server``, see
``test_vllm_server_launch.py``), or in-process with :func:`make_app`. ``--port 0`` binds a free port and prints
``vllm_api_server listening on http://HOST:PORT`` on stdout.
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

import numpy as np
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


SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy
# vLLM's --dtype choices besides "auto".
DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


# ---- the sampler: vLLM v1's steps, written from vLLM's code, sharing nothing with the actor's ----------------


def apply_penalties(
    logits: torch.Tensor, prompt: list[int], output: list[int], repetition: float, presence: float, frequency: float
) -> torch.Tensor:
    """vLLM's ``apply_penalties``: the repetition penalty on every token seen in the prompt or the output (positive
    logits divided by it, negative ones multiplied), frequency and presence penalties on the output's tokens only."""
    vocab = logits.shape[-1]
    prompt_seen = torch.zeros(vocab, dtype=torch.bool)
    prompt_seen[torch.tensor(prompt, dtype=torch.long)] = True
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab)[:vocab].to(logits.dtype)
    output_seen = counts > 0
    penalties = torch.where(prompt_seen | output_seen, repetition, 1.0).to(logits.dtype)
    logits = logits * torch.where(logits > 0, 1.0 / penalties, penalties)
    return logits - frequency * counts - presence * output_seen.to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """vLLM's ``MinPLogitsProcessor``: tokens less likely than ``min_p`` times the most likely one are masked."""
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, k: int | None, p: float | None) -> torch.Tensor:
    """vLLM's ``apply_top_k_top_p``: logits sorted ascending; top-k masks those below the k-th largest; top-p masks
    the lowest ones whose cumulative probability is at most ``1 - p`` (the largest is always kept)."""
    if k is None and p is None:
        return logits
    logits_sort, order = logits.sort(descending=False)
    if k is not None:
        logits_sort = logits_sort.masked_fill(logits_sort < logits_sort[logits_sort.numel() - k], float("-inf"))
    if p is not None:
        low = logits_sort.softmax(-1).cumsum(-1) <= 1 - p
        low[-1] = False
        logits_sort = logits_sort.masked_fill(low, float("-inf"))
    return logits_sort.scatter(-1, order, logits_sort)


def exponential_race(probs: torch.Tensor, rng: np.random.Generator) -> int:
    """vLLM's ``random_sample``: ``argmax(probs / q)`` with ``q ~ Exp(1)`` per token is a draw from ``probs``. The
    ``q`` come from the server's own RNG (numpy's), not from a torch generator the actor could share."""
    q = torch.from_numpy(rng.standard_exponential(probs.shape[-1])).to(probs.dtype)
    return int((probs / q).argmax())


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
    dtype: str = "auto",
    seed: int = 0,
) -> FastAPI:
    """``policy``: a ``TextPolicy`` (the server's own instance: its model is converted to ``dtype``) whose LoRA layout
    the adapters match; or ``policy_factory(r, alpha, modules)`` builds one per adapter layout (the command-line
    server). ``model_path``: where ``generation_config.json`` is. ``dtype``: vLLM's ``--dtype`` (``auto``: as
    loaded). ``seed``: vLLM's ``--seed``, the engine RNG that unseeded requests draw from."""
    if max_lora_rank not in MAX_LORA_RANKS:  # vLLM refuses it before serving anything
        raise ValueError(f"max_lora_rank ({max_lora_rank}) must be one of {MAX_LORA_RANKS}.")
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode {logprobs_mode!r} must be one of {LOGPROBS_MODES}")
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} must be 'auto' or one of {sorted(DTYPES)}")
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
    engine_rng = np.random.default_rng(seed)

    def served(pol):
        if dtype != "auto":
            pol.model.to(DTYPES[dtype])
        return pol

    base = served(policy if policy is not None else policy_factory(1, 1, ["q_proj"]))  # LoRA B = 0: the base model
    base_state = {id(base): base.weights_state_dict()}

    def policy_for(layout: tuple):
        if policy is not None:
            return policy
        if layout not in policies:
            policies[layout] = served(policy_factory(layout[0], layout[1], list(layout[2])))
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
        # vLLM gives a seeded request its own generator and lets the others draw from the engine's.
        rng = np.random.default_rng(int(p["seed"])) if p["seed"] is not None else engine_rng
        temp, min_p = float(p["temperature"]), float(p["min_p"])
        penalised = (p["repetition_penalty"], p["presence_penalty"], p["frequency_penalty"]) != (1.0, 0.0, 0.0)
        cur, past = list(prompt), None
        out_tokens, out_lps, finish, stop_reason = [], [], "length", None
        for _ in range(int(p["max_tokens"])):
            out = model(input_ids=torch.tensor([cur]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].to(torch.float32)  # vLLM samples and takes log-probs in float32
            vocab = logits.shape[-1]
            top_k = int(p["top_k"]) if 0 < int(p["top_k"]) < vocab else None  # 0 and -1 both mean "off"
            top_p = float(p["top_p"]) if float(p["top_p"]) < 1.0 else None
            x = logits
            if penalised:
                x = apply_penalties(
                    x,
                    prompt,
                    out_tokens,
                    float(p["repetition_penalty"]),
                    float(p["presence_penalty"]),
                    float(p["frequency_penalty"]),
                )
            if temp < SAMPLING_EPS:
                nxt = int(x.argmax())
            else:
                x = x / temp
                if min_p > 0:
                    x = apply_min_p(x, min_p)
                x = apply_top_k_top_p(x, top_k, top_p)
                nxt = exponential_race(x.softmax(-1, dtype=torch.float32), rng)
            # Raw: the model's logits before any processing; processed: what the token was drawn from.
            scores = logits if logprobs_mode.startswith("raw_") else x
            lp = scores.log_softmax(-1, dtype=torch.float32)[nxt] if logprobs_mode.endswith("logprobs") else scores[nxt]
            out_tokens.append(nxt)
            out_lps.append(max(float(lp), -9999.0))  # vLLM's clamp: JSON has no -inf
            if nxt in stop:
                finish = "stop"
                # vLLM's stop_reason: the stop token when it is one of stop_token_ids, None for an EOS stop.
                stop_reason = nxt if nxt in set(p["stop_token_ids"] or []) else None
                break
            cur = [nxt]
        return {
            "tokens": out_tokens,
            "logprobs": out_lps,
            "finish_reason": finish,
            "stop_reason": stop_reason,
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
                    {
                        "index": 0,
                        "text": res["text"],
                        "logprobs": logprobs,
                        "finish_reason": res["finish_reason"],
                        "stop_reason": res["stop_reason"],
                        "prompt_logprobs": None,
                    }
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
    ap.add_argument("--dtype", default="auto", choices=("auto", *DTYPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=8000, help="0: a free port, printed on stdout once bound")
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
        dtype=args.dtype,
        seed=args.seed,
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

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    sock = config.bind_socket()  # bound here, so --port 0 has a port to report before serving
    print(f"vllm_api_server listening on http://{args.host}:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
