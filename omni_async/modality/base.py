"""What every modality provides (:class:`Modality`) and the helpers they share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from omni_async.algos.loss_modes import LossMode
from omni_async.sample import Sample


class Modality(ABC):
    """What every modality provides. :meth:`build_policy` is common to all: each gives its policy class
    (:meth:`trainable_policy`) and, where it has one, an inference server's client (:meth:`serving_client`)."""

    name: str
    uses_window: bool  # generation takes an SDE window (diffusion) or not (text)
    # the diffusion loss's registry entry (algos.loss_modes), which the trainer asks what the batch needs; text: None
    mode: LossMode | None = None

    @abstractmethod
    def sampling_config(self, cfg: Any) -> Any:
        """The policy's sampling settings from the trainer config (a dataclass; shipped to workers as a dict)."""

    @abstractmethod
    def validation_sampling(self, cfg: Any) -> dict[str, Any] | None:
        """The sampling settings validation overrides (``rollout.val_kwargs``), or ``None``: the training ones."""

    @abstractmethod
    def prompt_lengths(self, model_path: str, prompts: list[str]) -> list[int]:
        """Each prompt's length in tokens, as ``data.max_prompt_length`` counts them."""

    def build_policy(
        self,
        model: dict[str, Any],
        sampling: dict[str, Any],
        device: str = "cpu",
        rollout_server: dict[str, Any] | None = None,
        dtype: torch.dtype = torch.float32,
        compile_blocks: bool = False,
    ) -> Any:
        """The trainable policy on ``device`` with frozen weights in ``dtype`` (``actor_rollout_ref.model``), or, for
        a rollout worker with ``rollout_server`` (``rollout.name=vllm``), a client of an inference server.
        ``compile_blocks``: verl's ``actor.use_torch_compile`` (``models.acceleration``)."""
        if rollout_server is not None:
            return self.serving_client(model, sampling, rollout_server)
        kwargs = trainable_kwargs(model, device, dtype)
        return self.trainable_policy(model["path"], sampling, **kwargs, compile_blocks=compile_blocks)

    @abstractmethod
    def trainable_policy(self, path: str, sampling: dict[str, Any], **trainable: Any) -> Any:
        """This modality's policy on ``path`` (``trainable``: :func:`trainable_kwargs`)."""

    @abstractmethod
    def serving_client(self, model: dict[str, Any], sampling: dict[str, Any], server: dict[str, Any]) -> Any:
        """A rollout-only client of an inference server (it samples and takes LoRA weights, it does not train)."""

    @abstractmethod
    def batch_tensors(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        """The actor's tensors for scored samples, including verl's ``rm_scores``."""

    @abstractmethod
    def log_probs(self, policy: Any, batch: Any) -> torch.Tensor:
        """Log-probs of the stored trajectories under the policy's current weights."""

    @abstractmethod
    def loss_units(self, batch: Any) -> int:
        """What the loss averages over in ``batch``: kept samples (images) or kept response tokens (text)."""

    @abstractmethod
    def backward(
        self, policy: Any, batch: Any, loss_mask: torch.Tensor, actor_cfg: Any, loss_scale: float = 1.0
    ) -> dict[str, list[float]]:
        """Accumulate ``loss_scale`` x the gradient of the batch's loss; return its metrics."""

    @abstractmethod
    def save_samples(self, out_dir: Path, step: int, samples: list[Sample]) -> Path:
        """Something a person can look at: an image grid, or a JSONL of responses."""


# A backward's seconds spent in the reference policy (KL): reported as the step's timing_s/ref.
REF_TIME_KEY = "timing_s/ref"


MODEL_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


def model_dtype(name: str | None, device: str) -> torch.dtype:
    """verl-omni's ``actor.fsdp_config.model_dtype``: the frozen weights' dtype; ``None`` = bf16 on CUDA, fp32 on CPU."""
    if name is None:
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if str(name) not in MODEL_DTYPES:
        raise ValueError(f"actor_rollout_ref.actor.fsdp_config.model_dtype={name!r}: use bf16, fp16 or fp32")
    return MODEL_DTYPES[str(name)]


def gradient_checkpointing(model: dict[str, Any], device: str) -> bool:
    """verl's ``model.enable_gradient_checkpointing``; ``None`` = on for CUDA (memory), off on CPU (speed)."""
    flag = model.get("enable_gradient_checkpointing")
    return device.startswith("cuda") if flag is None else bool(flag)


def plain_dict(node: Any) -> dict[str, Any]:
    """A config mapping (an OmegaConf node or a dict holding some) as plain nested dicts; ``None``: ``{}``."""
    from omegaconf import OmegaConf

    if node is None:
        return {}
    if OmegaConf.is_config(node):
        return OmegaConf.to_container(node, resolve=True)
    return {k: plain_dict(v) if isinstance(v, dict) or OmegaConf.is_config(v) else v for k, v in node.items()}


def trainable_kwargs(model: dict[str, Any], device: str, dtype: torch.dtype) -> dict[str, Any]:
    """The policy constructors' shared arguments, from ``actor_rollout_ref.model`` and the worker's device."""
    return dict(
        lora_rank=model["lora_rank"],
        lora_alpha=model["lora_alpha"],
        target_modules=list(model["target_modules"]),
        device=device,
        dtype=dtype,
        gradient_checkpointing=gradient_checkpointing(model, device),
        override_config=plain_dict(model.get("override_config")),
        attn_backend=model.get("attn_backend", "native"),  # verl-omni's; diffusers' backend (models.acceleration)
    )


def score_labels(samples: list[Sample]) -> list[str]:
    return [f"{s.outcome.score:.3f}" if s.outcome.ok else s.outcome.status for s in samples]


def rm_score(s: Sample) -> float:
    """A failed sample's ``rm_scores`` entry: 0, and its ``loss_mask`` keeps it out of every statistic."""
    return s.outcome.score if s.outcome.ok else 0.0
