"""The stand-in for verl-omni's latent DRM reward client (``verl_omni/utils/reward_score/latent_http_scorer_client.py``,
``compute_score``) in the recipe tests (``verl_omni_recipe_data.STAND_INS``): no DRM server (a diffusion reward model
scoring SD3.5 latents) runs here, so the raw score is computed in-process from what the client would send.

Everything else is verl-omni's contract, and stricter: its signature (``server_url``, ``noise_level``, ``noise_seed``,
``score_scale``, ``score_bias``, ``timeout``, ``max_retries``, ``retry_backoff``), an ``async def`` as upstream's, the
tensors it reads exactly as its ``_serialize_request`` reads them (the latent from ``extra_info["latents_clean"]``
with ``output_type=both``, else ``solution_image`` when it is a latent, i.e. ``output_type=latent`` (upstream tells
that by 16 channels, SD3.5's; tiny:sd3's latent has 4, so here by its floating-point dtype);
``extra_info["prompt_embeds"]`` of rank 2 or 3 and ``["pooled_prompt_embeds"]`` of rank 1 or 2, one sample each) and
its return (``{"score": raw * score_scale + score_bias, "drm_raw_score": raw}``). Unlike a server it also refuses a
latent that is not floating point (uint8 pixels sent by mistake).

The raw score: the latent noised to level ``u = noise_level`` on the flow-matching path, ``x_u = (1 - u) x0 + u e``
(``e`` from ``noise_seed``, 0 when null), scored as ``-mean(x_u^2) + 0.01 mean(pooled_prompt_embeds)``: the latent
term differs from sample to sample, the prompt term from prompt to prompt."""

from __future__ import annotations

from typing import Any

import torch


def batched(value: Any, name: str, rank: int) -> torch.Tensor:
    """verl-omni's ``_batched_tensor``: a one-sample tensor of ``rank`` (or one less, a batch axis then added)."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    value = value.detach()
    if value.ndim == rank - 1:
        value = value.unsqueeze(0)
    elif value.ndim != rank:
        raise ValueError(f"{name} must have rank {rank - 1} or {rank}, got shape {tuple(value.shape)}")
    if value.shape[0] != 1:
        raise ValueError(f"one sample per call, but {name} has batch size {value.shape[0]}")
    return value.cpu().contiguous()


def request_tensors(solution_image: Any, extra_info: dict, noise_level: float) -> dict[str, torch.Tensor]:
    """What verl-omni's client packs into its safetensors request (without the seeds)."""
    latents = extra_info.get("latents_clean")
    if latents is None and isinstance(solution_image, torch.Tensor) and solution_image.is_floating_point():
        latents = solution_image  # upstream: shape[-3] == 16 (SD3.5's latent channels; tiny:sd3 has 4)
    tensors = {
        "latents": batched(latents, "latents_clean", 4),
        "prompt_embeds": batched(extra_info.get("prompt_embeds"), "prompt_embeds", 3),
        "pooled_prompt_embeds": batched(extra_info.get("pooled_prompt_embeds"), "pooled_prompt_embeds", 2),
        "u": torch.tensor([noise_level], dtype=torch.float32),
    }
    if not tensors["latents"].is_floating_point():
        raise ValueError(f"latents_clean must be a floating-point latent, got {tensors['latents'].dtype}")
    return tensors


async def compute_score(
    solution_image: torch.Tensor,
    ground_truth: str,
    extra_info: dict,
    server_url: str,
    noise_level: float = 0.4,
    noise_seed: int | None = 0,
    score_scale: float = 1.0,
    score_bias: float = 0.0,
    timeout: float = 120.0,
    max_retries: int = 2,
    retry_backoff: float = 0.5,
    **kwargs: Any,
) -> dict[str, float]:
    if not 0 <= noise_level <= 1:
        raise ValueError(f"noise_level must be in [0, 1], got {noise_level}")
    t = request_tensors(solution_image, extra_info, noise_level)
    x0 = t["latents"].float()
    e = torch.randn(x0.shape, generator=torch.Generator().manual_seed(int(noise_seed or 0)))
    x_u = (1 - noise_level) * x0 + noise_level * e
    raw = float(-x_u.pow(2).mean() + 0.01 * t["pooled_prompt_embeds"].float().mean())
    return {"score": raw * score_scale + score_bias, "drm_raw_score": raw}
