"""A stand-in for vLLM's OpenAI-compatible server (vLLM cannot be installed here): the same routes and payloads
the vLLM text rollout uses (``/health``, ``/v1/completions`` with token-id prompts, seeds, ``logprobs`` and
``return_tokens_as_token_ids``, ``/v1/load_lora_adapter`` with a peft adapter dir), answered by the project's own
transformers text policy on the tiny model, so its outputs can be checked token for token."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from safetensors.torch import load_file


def make_app(policy) -> FastAPI:
    app = FastAPI()
    loaded = {"base"}

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request):
        body = await request.json()
        state = load_file(str(Path(body["lora_path"]) / "adapter_model.safetensors"))
        policy.load_weights_state_dict({k.removeprefix("base_model.model."): v for k, v in state.items()})
        loaded.add(body["lora_name"])
        return f"Success: LoRA adapter '{body['lora_name']}' added successfully."

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if body["model"] not in loaded:
            return JSONResponse({"object": "error", "message": f"The model `{body['model']}` does not exist."}, 404)
        policy.sampling.response_length = body["max_tokens"]
        policy.sampling.temperature = body["temperature"]
        rec = policy.sample_from_ids([body["prompt"]], [body["seed"]])[0]
        return {"object": "text_completion", "model": body["model"], "choices": [{
            "index": 0, "text": rec["response"], "finish_reason": "stop",
            "logprobs": {"tokens": [f"token_id:{t}" for t in rec["response_ids"]],
                         "token_logprobs": rec["log_probs"].tolist(), "top_logprobs": None, "text_offset": []}}]}

    return app
