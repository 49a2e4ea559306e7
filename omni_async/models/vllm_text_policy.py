"""Text rollout through a vLLM server (GPU clusters): ``actor_rollout_ref.rollout.name=vllm`` with
``actor_rollout_ref.model.modality=text``.

The rollout replica starts ``<server_python> -m vllm.entrypoints.openai.api_server --enable-lora`` on its device
(vLLM lives in its own environment; see :mod:`omni_async.reward.vllm_server`) or, with
``actor_rollout_ref.rollout.server_url``, uses one already running. Per sample it asks ``/v1/completions`` for one
response to the chat-templated prompt *token ids*, with the sample's seed, and reads back the token ids
(``return_tokens_as_token_ids``) and their log-probs. A batch's requests are sent at once (vLLM batches the
requests it has in flight; one at a time it never would).

What vLLM does on its own that would make its samples differ from what the actor scores, and what is done about it:

- **Sampling defaults.** A field a request leaves out takes the model's ``generation_config.json`` value (vLLM's
  ``--generation-config auto``; Qwen ships ``top_k=20, top_p=0.8, repetition_penalty=1.05``). Every request pins
  plain temperature sampling (:data:`PINNED_SAMPLING`), the distribution :class:`TextPolicy` scores.
- **Log-probs.** vLLM returns log-probs of the raw logits (before temperature) unless the server runs with
  ``--logprobs-mode processed_logprobs`` (vLLM >= 0.10.2). A launched server gets that flag; with ``server_url`` and
  temperature != 1 the client checks the mode once at start and refuses a raw-mode server (π_old would be wrong).
- **Stopping.** vLLM stops at the tokenizer's EOS *and* the ids of ``generation_config.eos_token_id``; the actor
  stops at the generation config's ids only. Requests send ``ignore_eos`` with those ids as ``stop_token_ids``.
- **LoRA rank.** ``--max-lora-rank`` accepts only :data:`omni_async.models.vllm_launch.VLLM_MAX_LORA_RANKS`; the
  launch rounds the model's rank up (48 -> 64). The adapter keeps its true rank (vLLM needs rank <= max).

Weight sync: the trainer's LoRA weights are written as a peft adapter directory and loaded with
``/v1/load_lora_adapter`` under the name ``v<n>``; later requests use it, and the previous adapter is unloaded
(``/v1/unload_lora_adapter``, its directory deleted) as soon as no request in flight uses it. Full fine-tuning
needs weight broadcast into vLLM, which is not built: LoRA only (checked at start).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import httpx
import torch

from omni_async.models.rollout_policy import refuse_inapplicable
from omni_async.models.text_policy import TextSamplingConfig, chat_prompt_ids
from omni_async.models.tiny import resolve_model_path
from omni_async.models.tokens import eos_ids
from omni_async.sample import TextResult

# Plain temperature sampling: every field vLLM would otherwise fill from generation_config.json (top_k / top_p /
# min_p / repetition_penalty) or from OpenAI defaults set to "off". top_k=-1 means "disabled" in every vLLM version
# (newer ones also take 0, older ones refuse 0).
PINNED_SAMPLING = {
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
}
MAX_CONCURRENT_REQUESTS = 64


def generation_eos_ids(model_path: str, tokenizer) -> list[int]:
    """The EOS ids :class:`TextPolicy` stops at: ``generation_config.eos_token_id`` (an int or a list; from the model
    config when there is no generation_config.json), else the tokenizer's EOS."""
    from transformers import AutoConfig, GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_path)).eos_token_id
    return eos_ids(eos, tokenizer)


class VLLMTextPolicy:
    continuous_batching: ClassVar[bool] = False  # the vLLM server batches the requests it is sent

    def __init__(
        self,
        model_path: str,
        sampling: TextSamplingConfig,
        *,
        lora_rank: int,
        lora_alpha: int,
        target_modules: list[str],
        server: dict[str, Any],
    ):
        from transformers import AutoTokenizer

        self.path = resolve_model_path(model_path)
        self.tok = AutoTokenizer.from_pretrained(self.path)
        self.eos_ids = generation_eos_ids(self.path, self.tok)
        self.sampling, self.timeout_s = sampling, float(server.get("timeout_s", 120))
        self.lora = {"r": int(lora_rank), "lora_alpha": int(lora_alpha), "target_modules": list(target_modules)}
        self.model_name, self.adapters = "base", Path(tempfile.mkdtemp(prefix="omni_async_lora_"))
        self.loads = 0
        # Adapter name -> requests in flight that use it; a replaced adapter is unloaded when its count is 0.
        self._lock, self._in_use, self._retired = threading.Lock(), {}, set()
        self.proc = None
        self.client = httpx.Client(
            timeout=self.timeout_s,
            limits=httpx.Limits(
                max_connections=MAX_CONCURRENT_REQUESTS, max_keepalive_connections=MAX_CONCURRENT_REQUESTS
            ),
        )
        self.pool = ThreadPoolExecutor(max_workers=MAX_CONCURRENT_REQUESTS, thread_name_prefix="vllm-request")
        if server.get("server_url"):
            self.url = str(server["server_url"]).rstrip("/")
            if float(self.sampling.temperature) != 1.0:
                self._check_processed_logprobs()
        else:
            self.url = self._launch(server)

    def _launch(self, server: dict[str, Any]) -> str:
        from omni_async.models.vllm_launch import free_port, normalize_server_args, start_vllm, vllm_max_lora_rank

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [
            str(server["server_python"]),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.path,
            "--served-model-name",
            "base",
            "--enable-lora",
            "--max-lora-rank",
            str(vllm_max_lora_rank(self.lora["r"], "actor_rollout_ref.model.lora_rank")),
            "--logprobs-mode",
            "processed_logprobs",
            "--gpu-memory-utilization",
            str(server["gpu_memory_utilization"]),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *normalize_server_args(
                server.get("server_args") or [], "actor_rollout_ref.rollout.server_args", min_lora_rank=self.lora["r"]
            ),
        ]
        # Runtime LoRA loading is off in vLLM unless this is set.
        self.proc = start_vllm(
            cmd, url, "actor_rollout_ref.rollout.server_python", {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        )
        return url

    def _check_processed_logprobs(self) -> None:
        """With top_k=1 the processed log-prob of the one token left is exactly 0; a raw one is log p < 0."""
        body = {
            "model": "base",
            "prompt": self.prompt_ids("Hi"),
            "max_tokens": 1,
            "temperature": 1.0,
            "seed": 0,
            "logprobs": 0,
            **PINNED_SAMPLING,
            "top_k": 1,
        }
        lp = self._post(body)["choices"][0]["logprobs"]["token_logprobs"][0]
        if lp is None or abs(float(lp)) > 1e-6:
            raise RuntimeError(
                f"the vLLM server at actor_rollout_ref.rollout.server_url={self.url} returns raw (pre-temperature) "
                f"log-probs (probe: {lp}), so π_old would be wrong at temperature {self.sampling.temperature}. Fix: "
                "start it with --logprobs-mode processed_logprobs (vLLM >= 0.10.2)"
            )

    def prompt_ids(self, prompt: str) -> list[int]:
        return chat_prompt_ids(self.tok, prompt)

    def request_body(self, prompt_ids: list[int], seed: int) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "prompt": prompt_ids,
            "max_tokens": int(self.sampling.response_length),
            "temperature": float(self.sampling.temperature),
            **PINNED_SAMPLING,
            "seed": int(seed),
            "ignore_eos": True,
            "stop_token_ids": list(self.eos_ids),
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            r = self.client.post(f"{self.url}/v1/completions", json=body)
        except httpx.HTTPError as e:
            raise RuntimeError(f"vLLM rollout server {self.url}/v1/completions: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise RuntimeError(f"vLLM rollout server {self.url} answered HTTP {r.status_code}: {r.text[:200]}")
        return r.json()

    def generate(
        self,
        prompts: list[str],
        seeds: list[int],
        windows: list[range] | None = None,
        *,
        sampling: dict[str, Any] | None = None,
        resume: list[Any] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[TextResult]:
        """One response per (prompt, seed); the batch's requests are in flight together, all on one adapter. (The
        server batches them; no windows, other sampling settings or partial rollout here: ``models.rollout_policy``.)"""
        refuse_inapplicable(
            "VLLMTextPolicy", windows=windows, sampling=sampling, resume=resume, should_stop=should_stop
        )
        rows = [self.prompt_ids(p) for p in prompts]  # the tokenizer stays on this thread
        with self._lock:
            adapter = self.model_name
            self._in_use[adapter] = self._in_use.get(adapter, 0) + 1
        try:
            futures = [
                self.pool.submit(self._post, {**self.request_body(ids, seed), "model": adapter})
                for ids, seed in zip(rows, seeds, strict=True)
            ]
            answers = [f.result()["choices"][0]["logprobs"] for f in futures]
        finally:
            with self._lock:
                self._in_use[adapter] -= 1
                idle = self._in_use[adapter] == 0 and adapter in self._retired
            if idle:
                try:
                    self._unload(adapter)
                except RuntimeError as e:  # the samples are good; a stale adapter only costs server memory
                    warnings.warn(str(e), stacklevel=2)
        results = []
        for ids, lp in zip(rows, answers, strict=True):
            response_ids = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
            results.append(
                TextResult(
                    prompt_ids=ids,
                    response_ids=response_ids,
                    response=self.tok.decode(response_ids, skip_special_tokens=True),
                    log_probs=torch.tensor(lp["token_logprobs"], dtype=torch.float32),
                )
            )
        return results

    def load_weights_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Write ``state`` as a peft adapter directory, load it into the server under a new name, unload the old."""
        from safetensors.torch import save_file

        self.loads += 1
        name = f"v{self.loads}"
        out = self.adapters / name
        out.mkdir(parents=True, exist_ok=True)
        save_file(
            {f"base_model.model.{k}": v.contiguous() for k, v in state.items()}, str(out / "adapter_model.safetensors")
        )
        (out / "adapter_config.json").write_text(
            json.dumps(
                {
                    "peft_type": "LORA",
                    "task_type": "CAUSAL_LM",
                    "base_model_name_or_path": self.path,
                    "bias": "none",
                    "r": self.lora["r"],
                    "lora_alpha": self.lora["lora_alpha"],
                    "target_modules": self.lora["target_modules"],
                }
            )
        )
        r = self.client.post(f"{self.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(out)})
        if r.status_code != 200:
            shutil.rmtree(out, ignore_errors=True)
            raise RuntimeError(
                f"vLLM ({self.url}) refused the LoRA adapter {name}: HTTP {r.status_code}: {r.text[:200]}"
            )
        with self._lock:
            old, self.model_name = self.model_name, name
            idle = old != "base" and self._in_use.get(old, 0) == 0
            if old != "base" and not idle:
                self._retired.add(old)  # the last batch using it unloads it
        if idle:
            self._unload(old)

    def _unload(self, name: str) -> None:
        with self._lock:
            self._retired.discard(name)
            self._in_use.pop(name, None)
        r = self.client.post(f"{self.url}/v1/unload_lora_adapter", json={"lora_name": name})
        if r.status_code != 200:
            raise RuntimeError(
                f"vLLM ({self.url}) did not unload the LoRA adapter {name}: HTTP {r.status_code}: {r.text[:200]}"
            )
        shutil.rmtree(self.adapters / name, ignore_errors=True)

    def __del__(self):
        if getattr(self, "pool", None) is not None:
            self.pool.shutdown(wait=False)
        if getattr(self, "proc", None) is not None:
            self.proc.terminate()
