"""The frozen distillation teacher (DiffusionOPD: ``distillation.teacher_models.teacher_model``), a scorer that lives
where the reward does.

verl-omni fuses its teacher into the actor worker and scores each whole batch once per step, before the update
(one step behind the rollout in its overlapped trainer). Here it runs beside the reward function on each
reward-loop worker (on the reward pool with ``reward.reward_model.enable_resource_pool``): every finished training
sample's reward record carries its SDE window (``window_latents``, ``window_start``) and prompt encodings under
:data:`TEACHER_INPUT` as well as its pixels, and the worker returns the teacher's velocity at each window step with the reward outcome
(``RewardOutcome.teacher_velocity`` [W, ...], fp32), so its scoring overlaps generation as the reward's does and the
batch arrives at the update complete. With ``reward.streaming=false`` it runs where the colocated reward runs (the
trainer process), after rollout. The reward function never sees the trajectory (the worker takes it out of the
record first). Validation samples are not sent to it: they train nothing.

The teacher replays the student's states on the student's noise grid, as verl-omni's does: it takes the student's
prompt encodings (a teacher of the student's family, fine-tuned: the same text encoders), runs its own transformer
with the student's CFG settings, one call per sample and step (the student's per-sample shapes), and the update
turns the velocity into the step mean with the student's own SDE step (``DiffusionPolicy.step_with``,
``algos.distill``). Its scheduler must be the student's (verl-omni's start check), checked when it loads.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import torch

from omni_async.sample import ImageResult

logger = logging.getLogger(__name__)

# The reward record's key of a training sample's trajectory (trajectory_fields), read by the worker's teacher only.
TEACHER_INPUT = "teacher_input"


def teacher_spec(cfg: Any) -> dict[str, Any] | None:
    """What a teacher needs to load, from the run's config (plain data for a Ray actor); ``None`` without
    ``distillation.enabled``."""
    if not cfg.distillation.enabled:
        return None
    from omegaconf import OmegaConf

    from omni_async.modality import modality_of

    arr = cfg.actor_rollout_ref
    return {
        "model_path": str(cfg.distillation.teacher_models.teacher_model.model_path),
        "student_path": str(arr.model.path),
        "sampling": vars(modality_of(cfg).sampling_config(cfg)),
        "model_dtype": OmegaConf.select(cfg, "actor_rollout_ref.actor.fsdp_config.model_dtype"),
    }


def trajectory_fields(result: ImageResult) -> dict[str, torch.Tensor]:
    """The sample's SDE window and prompt encodings: the teacher's input (:meth:`Teacher.velocities`)."""
    return {
        "window_latents": result.window_latents,
        "window_start": torch.tensor(int(result.window_start)),
        **result.conditioning,
    }


class Teacher:
    def __init__(self, spec: dict[str, Any], device: str = "cpu"):
        """Load the frozen teacher of ``spec`` (:func:`teacher_spec`) on ``device``, its weights in the actor's
        ``fsdp_config.model_dtype``; a scheduler that differs from the student's raises naming both paths."""
        from omni_async.modality.base import model_dtype
        from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig

        _check_same_scheduler(spec["model_path"], spec["student_path"])
        dtype = model_dtype(spec.get("model_dtype"), device)
        self.policy = DiffusionPolicy(
            spec["model_path"], SamplingConfig(**spec["sampling"]), device=device, dtype=dtype, lora_rank=0
        )
        self.policy.trainable.requires_grad_(False)  # frozen: rank 0 marks the transformer trainable
        self._lock = threading.Lock()  # one transformer: samples scored concurrently take turns
        logger.info("distillation teacher %s loaded on %s (%s)", spec["model_path"], device, dtype)

    @torch.no_grad()
    def velocities(self, trajectory: dict[str, torch.Tensor]) -> torch.Tensor:
        """The teacher's (CFG-guided) velocity at each step of one sample's window, ``[W, ...]`` fp32 on the CPU;
        ``trajectory``: :func:`trajectory_fields`."""
        start = int(trajectory["window_start"])
        with self._lock:
            # One sample and no log-prob taken from it: the batch's own call, not the SDE window's fixed-size ones.
            batch = {k: torch.as_tensor(v)[None] for k, v in trajectory.items()}
            cond = self.policy.conditioning_from(batch, batched=True)
            x = torch.as_tensor(trajectory["window_latents"])[None].to(self.policy.device)
            steps = [self.policy.velocity(cond, x[:, j], start + j, per_sample=False) for j in range(x.shape[1] - 1)]
        return torch.stack(steps, 1)[0].float().cpu()


def _check_same_scheduler(teacher: str, student: str) -> None:
    """verl-omni's start check: the teacher replays the student's trajectories on the student's noise grid, so both
    must resolve to one scheduler config (read from the checkpoints' ``scheduler/`` when both are directories)."""
    from omni_async.models.tiny import resolve_model_path

    configs = []
    for path in (teacher, student):
        f = Path(resolve_model_path(path)) / "scheduler" / "scheduler_config.json"
        if not f.is_file():
            return  # a hub id or random:<family>: nothing to read here
        configs.append({k: v for k, v in json.loads(f.read_text()).items() if not k.startswith("_")})
    if configs[0] != configs[1]:
        raise ValueError(
            f"distillation.teacher_models.teacher_model.model_path={teacher!r} has another scheduler than the student "
            f"{student!r} ({configs[0]} vs {configs[1]}); the teacher replays the student's steps on the student's "
            "noise grid: give a teacher of the student's family with its scheduler"
        )
