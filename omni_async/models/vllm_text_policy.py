"""Text rollout through a vLLM server (GPU clusters): ``actor_rollout_ref.rollout.name=vllm`` with
``actor_rollout_ref.model.modality=text``.

The rollout replica starts ``<server_python> -m vllm.entrypoints.openai.api_server --enable-lora`` on its device
(vLLM lives in its own environment; see :mod:`omni_async.reward.vllm_server`) or, with
``actor_rollout_ref.rollout.server_url``, uses one already running. Per sample it asks ``/v1/completions`` for one
response to the chat-templated prompt *token ids*, with the sample's seed, and reads back the token ids
(``return_tokens_as_token_ids``) and their log-probs. Weight sync: the trainer's LoRA weights are written as a
peft adapter directory and loaded with ``/v1/load_lora_adapter`` under the name ``v<version>``; later requests use
it. Full fine-tuning needs weight broadcast into vLLM, which is not built: LoRA only (checked at start).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import httpx
import torch

from omni_async.models.text_policy import TextSamplingConfig
from omni_async.models.tiny import resolve_model_path


class VLLMTextPolicy:
    def __init__(self, model_path: str, sampling: TextSamplingConfig, *, lora_rank: int, lora_alpha: int,
                 target_modules: list[str], server: dict[str, Any]):
        from transformers import AutoTokenizer

        self.path = resolve_model_path(model_path)
        self.tok = AutoTokenizer.from_pretrained(self.path)
        self.sampling, self.timeout_s = sampling, float(server.get("timeout_s", 120))
        self.lora = {"r": int(lora_rank), "lora_alpha": int(lora_alpha), "target_modules": list(target_modules)}
        self.model_name, self.adapters = "base", Path(tempfile.mkdtemp(prefix="omni_async_lora_"))
        self.proc = None
        self.url = (server.get("server_url") or "").rstrip("/") or self._launch(server)
        self.client = httpx.Client(timeout=self.timeout_s)

    def _launch(self, server: dict[str, Any]) -> str:
        from omni_async.reward.vllm_server import free_port, start_vllm

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [str(server["server_python"]), "-m", "vllm.entrypoints.openai.api_server", "--model", self.path,
               "--served-model-name", "base", "--enable-lora", "--max-lora-rank", str(self.lora["r"]),
               "--gpu-memory-utilization", str(server["gpu_memory_utilization"]), "--host", "127.0.0.1",
               "--port", str(port), *[str(a) for a in server.get("server_args") or []]]
        # Runtime LoRA loading is off in vLLM unless this is set.
        self.proc = start_vllm(cmd, url, "actor_rollout_ref.rollout.server_python",
                               {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
        return url

    def prompt_ids(self, prompt: str) -> list[int]:
        text = self.tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                            add_generation_prompt=True)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def sample_records(self, prompts: list[str], seeds: list[int], window: Any = None) -> list[dict[str, Any]]:
        records = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            ids = self.prompt_ids(prompt)
            body = {"model": self.model_name, "prompt": ids, "max_tokens": int(self.sampling.response_length),
                    "temperature": float(self.sampling.temperature), "seed": int(seed), "logprobs": 0,
                    "return_tokens_as_token_ids": True, "skip_special_tokens": False}
            r = self.client.post(f"{self.url}/v1/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"vLLM rollout server answered HTTP {r.status_code}: {r.text[:200]}")
            lp = r.json()["choices"][0]["logprobs"]
            response_ids = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
            records.append({"prompt_ids": ids, "response_ids": response_ids,
                            "response": self.tok.decode(response_ids, skip_special_tokens=True),
                            "log_probs": torch.tensor(lp["token_logprobs"], dtype=torch.float32)})
        return records

    def load_weights_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Write ``state`` as a peft adapter directory and load it into the server under a new name."""
        from safetensors.torch import save_file

        self.loads = getattr(self, "loads", 0) + 1
        name = f"v{self.loads}"
        out = self.adapters / name
        out.mkdir(parents=True, exist_ok=True)
        save_file({f"base_model.model.{k}": v.contiguous() for k, v in state.items()},
                  str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": self.path, "bias": "none",
            "r": self.lora["r"], "lora_alpha": self.lora["lora_alpha"], "target_modules": self.lora["target_modules"],
        }))
        r = self.client.post(f"{self.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(out)})
        if r.status_code != 200:
            raise RuntimeError(f"vLLM refused the LoRA adapter {name}: HTTP {r.status_code}: {r.text[:200]}")
        self.model_name = name

    def __del__(self):
        if self.proc is not None:
            self.proc.terminate()
