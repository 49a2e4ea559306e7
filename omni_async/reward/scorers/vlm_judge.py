"""VLM judge (GenRM-OCR): a vision-language model transcribes the text in the image; the transcription is scored
against the ground truth with the OCR rule (edit distance, :func:`omni_async.reward.scorers.ocr.ocr_similarity`).

    reward.custom_reward_function.path=pkg://omni_async.reward.scorers.vlm_judge
    reward.custom_reward_function.name=compute_score
    +reward.custom_reward_function.reward_kwargs.backend=transformers      # or openai
    reward.reward_model.model_path=tiny:qwen2_vl                           # transformers: a local dir / tiny:
    +reward.custom_reward_function.reward_kwargs.base_url=http://judge:8000   # openai: the server(s)

The judge model has one key, ``reward.reward_model.model_path`` (the vLLM judge servers serve the same path); the
reward manager hands it over as ``judge_model_path``, and a ``model_path`` in the reward kwargs is refused at start.

Backends:

- ``transformers``: the judge loaded inside the reward-loop worker (once per process), inputs built with the PIL
  image processor (no torchvision), greedy decoding. One model call at a time per worker (a lock), run off the
  event loop.
- ``openai``: an OpenAI-compatible ``/v1/chat/completions`` server (vLLM on the reward pool on GPU clusters;
  see :mod:`omni_async.reward.vllm_server`), image as a PNG data URI, temperature 0 by default, async httpx
  with retries (:mod:`omni_async.reward.http_client`); several ``base_url`` s least-loaded.

``solution_image``: verl-omni's uint8 tensor ``(C, H, W)`` / ``(C, F, H, W)``, or numpy ``(H, W, 3)`` /
``(F, H, W, 3)``, or PIL. The judge's text is kept in the extra info (``judge_text``). Video: frames every
``frame_interval``, mean score.
"""

from __future__ import annotations

import asyncio
import base64
import threading
from typing import Any

import numpy as np
from PIL import Image

from omni_async.reward.http_client import Connection, RewardHTTPError
from omni_async.reward.scorers.http import encode_image
from omni_async.reward.scorers.jpeg import as_pil
from omni_async.reward.scorers.ocr import ocr_similarity, sample_frames

DEFAULT_INSTRUCTION = "Transcribe all text in the image exactly. Answer with the text only."


class TransformersJudge:
    """A Qwen2-VL-style judge in this process (``tiny:qwen2_vl`` builds offline)."""

    def __init__(self, model_path: str, max_new_tokens: int = 32, instruction: str = DEFAULT_INSTRUCTION):
        import torch
        from transformers import AutoModelForImageTextToText, AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from omni_async.models.tiny import resolve_model_path

        path = resolve_model_path(model_path)
        self.tok = AutoTokenizer.from_pretrained(path)
        self.processor = Qwen2VLImageProcessorPil.from_pretrained(path)
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        self.max_new_tokens, self.instruction = int(max_new_tokens), instruction
        self.lock = threading.Lock()  # one generate at a time per model

    def transcribe(self, image: Image.Image) -> str:
        import torch

        pix = self.processor(images=[image.convert("RGB")], return_tensors="pt")
        n_tokens = int(pix["image_grid_thw"].prod()) // self.processor.merge_size**2
        text = self.tok.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": self.instruction}]}],
            tokenize=False,
            add_generation_prompt=True,
        ).replace("<|image_pad|>", "<|image_pad|>" * n_tokens)
        ids = self.tok(text, return_tensors="pt")
        with self.lock, torch.no_grad():
            out = self.model.generate(
                **ids, **pix, max_new_tokens=self.max_new_tokens, do_sample=False, pad_token_id=self.tok.pad_token_id
            )
        return self.tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


_judges: dict[tuple, TransformersJudge] = {}
_judges_lock = threading.Lock()


def transformers_judge(model_path: str, max_new_tokens: int, instruction: str) -> TransformersJudge:
    key = (model_path, max_new_tokens, instruction)
    with _judges_lock:  # loaded once per worker process, whatever the number of concurrent first calls
        if key not in _judges:
            _judges[key] = TransformersJudge(model_path, max_new_tokens, instruction)
        return _judges[key]


class OpenAIJudge:
    """Asks an OpenAI-compatible chat-completions server to transcribe the image."""

    def __init__(
        self,
        base_url: str | list[str],
        *,
        model: str = "judge",
        instruction: str = DEFAULT_INSTRUCTION,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        api_key: str | None = None,
        **connection: Any,
    ):
        """``connection``: the :class:`~omni_async.reward.http_client.Connection` fields (``timeout_s``,
        ``max_retries``, ``backoff_s``, ``seed``, ...); ``api_key`` is its bearer token."""
        self.http = Connection(base_url, token=api_key, **connection)
        self.model, self.max_new_tokens, self.temperature = model, int(max_new_tokens), float(temperature)
        self.instruction = instruction

    async def transcribe(self, image: Image.Image) -> str:
        uri = "data:image/png;base64," + base64.b64encode(encode_image(image, "png")).decode()
        body = {
            "model": self.model,
            "temperature": self.temperature,
            "max_tokens": self.max_new_tokens,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": uri}},
                        {"type": "text", "text": self.instruction},
                    ],
                }
            ],
        }
        response = await self.http.post("openai-judge", "/v1/chat/completions", json=body)
        try:
            return str(response.json()["choices"][0]["message"]["content"] or "")
        except (ValueError, KeyError, IndexError, TypeError):
            raise RewardHTTPError(
                f"judge answered 200 without choices[0].message.content: {response.text[:160]!r}"
            ) from None


_openai: dict[str, OpenAIJudge] = {}


async def compute_score(
    data_source: str,
    solution_image: Any,
    ground_truth: Any,
    extra_info: dict | None = None,
    backend: str = "transformers",
    judge_model_path: str | None = None,
    base_url: str | list[str] | None = None,
    frame_interval: int = 1,
    substring_shortcut: bool = True,
    max_new_tokens: int = 32,
    instruction: str = DEFAULT_INSTRUCTION,
    judge_urls: list[str] | None = None,
    **backend_kwargs: Any,
) -> dict[str, Any]:
    """Score = mean over frames of ``ocr_similarity(judge transcription, ground_truth)``.

    ``judge_urls``: the run's vLLM judge servers (``reward.reward_model.rollout.name=vllm``), handed over by the
    reward manager; when given they are the OpenAI-compatible backend's servers. ``judge_model_path``:
    ``reward.reward_model.model_path``, handed over by the reward manager (the transformers backend loads it).
    """
    if judge_urls:
        backend, base_url = "openai", list(judge_urls)
    frames = [as_pil(f) for f in sample_frames(solution_image, frame_interval)]
    if backend == "transformers":
        if not judge_model_path:
            raise ValueError(
                "vlm_judge backend=transformers needs the judge model: set "
                "reward.reward_model.model_path (a local dir, or tiny:qwen2_vl on CPU)"
            )
        judge = await asyncio.get_running_loop().run_in_executor(
            None, transformers_judge, judge_model_path, max_new_tokens, instruction
        )
        loop = asyncio.get_running_loop()
        texts = [await loop.run_in_executor(None, judge.transcribe, f) for f in frames]
    elif backend == "openai":
        if not base_url:
            raise ValueError("vlm_judge backend=openai needs base_url (the judge server, e.g. http://host:8000)")
        key = repr((base_url, max_new_tokens, instruction, sorted(backend_kwargs.items())))
        if key not in _openai:
            _openai[key] = OpenAIJudge(
                base_url, max_new_tokens=max_new_tokens, instruction=instruction, **backend_kwargs
            )
        texts = list(await asyncio.gather(*(_openai[key].transcribe(f) for f in frames)))
    else:
        raise ValueError(f"vlm_judge backend={backend!r}: use transformers or openai")
    gt = "" if ground_truth is None else str(ground_truth)
    scores = [ocr_similarity(t, gt, substring_shortcut) for t in texts]
    return {"score": float(np.mean(scores)), "judge_text": " | ".join(texts)}
