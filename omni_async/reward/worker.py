"""Reward-loop worker: a Ray actor that scores samples with the reward manager.

It serves verl's reward-loop API on one-row ``DataProto`` chunks, ``compute_score(data) -> {"reward_score",
"reward_extra_info"}``, and the typed forms: ``score(data) -> RewardOutcome``, and ``score_many(records)``, the
dispatcher's: several samples as plain records (``Sample.reward_input()``: a one-row ``DataProto`` cost the driver
about ten times as much to build and pickle, ``bench/driver_cost.py``'s unit costs), one call per turn of its loop.
The manager (and whatever engine its functions load: an OCR model, a judge, an HTTP client) is built once per
worker, so a worker on the dedicated reward pool keeps its model resident between steps. The actor is async:
one worker scores many samples at once (sync functions run in its thread pool, ``async def`` ones on its loop),
up to the dispatcher's per-worker in-flight limit.

A failure is never a fake score: the outcome's status says ``failed`` or ``timeout`` (in verl's form,
``reward_score`` is ``None`` and ``reward_extra_info`` carries ``reward_status`` and ``reward_error``).

Logging: a worker logs once that it started (its scorers, device and judge servers; INFO); each scored sample is
DEBUG at most (the dispatcher watches the failure rate).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from omegaconf import OmegaConf

from omni_async.cluster import resume_gc
from omni_async.logs import setup_logging
from omni_async.reward.manager import RewardManager
from omni_async.reward.teacher import TEACHER_INPUT, Teacher
from omni_async.sample import EXTRA_TENSORS, RewardOutcome, from_wire

if TYPE_CHECKING:
    # verl's reward-loop API types only: importing verl pulls in tensordict (torch._dynamo) and transformers, ~2 s of a
    # reward worker's start that the dispatcher's plain records never need.
    from verl import DataProto

logger = logging.getLogger(__name__)

# Per-sample fields a reward function may see; everything else (trajectory latents, embeddings) stays behind.
TEXT_FIELDS = (
    "prompt",
    "data_source",
    "ground_truth",
    "extra_info",
    "uid",
    "solution_str",
    "condition_images",
    EXTRA_TENSORS,  # output_type latent / both: wired tensors for extra_info, an object column
)
PIXELS = "solution_image"  # the one tensor field: uint8 pixels [1, (T,) H, W, 3], or a float latent, in a chunk


def sample_to_proto(sample: dict[str, Any]) -> DataProto:
    """The minimal one-row chunk sent to a reward worker (``sample`` is ``Sample.reward_input()``)."""
    import torch
    from verl import DataProto

    non_tensors = {}
    for key in TEXT_FIELDS:
        if key in sample:
            col = np.empty(1, dtype=object)
            col[0] = sample[key]
            non_tensors[key] = col
    tensors = None
    if PIXELS in sample:
        solution = from_wire(sample[PIXELS])  # a latent arrives wired (Sample.reward_input)
        tensors = {
            PIXELS: (solution if isinstance(solution, torch.Tensor) else torch.tensor(np.asarray(solution)))[None]
        }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def proto_to_sample(data: DataProto) -> dict[str, Any]:
    if len(data) != 1:
        raise ValueError(f"a reward-loop worker scores one sample per call, got a chunk of {len(data)} rows")
    sample = {key: data.non_tensor_batch[key][0] for key in data.non_tensor_batch}
    if data.batch is not None and PIXELS in data.batch.keys():
        solution = data.batch[PIXELS][0]
        sample[PIXELS] = solution if solution.is_floating_point() else solution.numpy()  # a latent stays a tensor
    return sample


class RewardLoopWorker:
    def __init__(
        self,
        reward_cfg: dict[str, Any],
        worker_index: int = 0,
        judge_urls: list[str] | None = None,
        teacher: dict[str, Any] | None = None,
    ):
        """``teacher``: the distillation teacher's spec (``reward.teacher.teacher_spec``), loaded on this worker's
        device (a reward-pool GPU, else the CPU) and run on each record that carries a trajectory."""
        setup_logging()  # idempotent: the process setup hook normally did it (level from $OMNI_ASYNC_LOG_LEVEL)
        t0 = time.perf_counter()
        self.worker_index = worker_index
        # Each worker starts its judge list at its own server, so functions given one server (verl-omni's
        # reward_router_address) spread over all of them, as verl's reward router would.
        urls = list(judge_urls or [])
        if urls:
            k = worker_index % len(urls)
            urls = urls[k:] + urls[:k]
        self.manager = RewardManager(OmegaConf.create(reward_cfg), urls)
        self.teacher = None
        if teacher is not None:
            from omni_async.cluster import configure_worker

            self.teacher = Teacher(teacher, configure_worker())  # its device, and this actor's torch threads
        self.calls = 0
        logger.info(
            "reward worker %d started: %s on %s, %d judge server(s), up to %s calls in flight, in %.1fs",
            worker_index,
            self.manager.scorer_names,
            _device(),
            len(urls),
            reward_cfg.get("max_inflight_per_worker"),
            time.perf_counter() - t0,
        )
        resume_gc()  # imports and reward functions loaded (cluster.pause_gc_while_importing)

    async def score(self, data: DataProto) -> RewardOutcome:
        """Score one sample; never raises for a bad sample or a failing function (the outcome says so)."""
        self.calls += 1
        return await self.manager.score(proto_to_sample(data))

    async def score_many(self, records: list[dict[str, Any]]) -> list[RewardOutcome]:
        """Score the samples the dispatcher sent together (``Sample.reward_input()`` records), concurrently; one
        outcome each."""
        self.calls += len(records)
        return list(await asyncio.gather(*(self._score_record(_writable(r)) for r in records)))

    async def _score_record(self, record: dict[str, Any]) -> RewardOutcome:
        """One record's reward outcome; a training sample's record also carries its trajectory (``TEACHER_INPUT``),
        which the teacher replays beside the reward (a failing teacher fails the sample). The reward function never
        sees the trajectory."""
        trajectory = record.pop(TEACHER_INPUT, None)
        if trajectory is None or self.teacher is None:
            return await self.manager.score(record)
        return await score_with_teacher(self.manager.score(record), self.teacher, trajectory)

    async def compute_score(self, data: DataProto) -> dict[str, Any]:
        """verl's reward-loop API: ``{"reward_score": float | None, "reward_extra_info": dict}``."""
        return (await self.score(data)).to_verl()

    def post_process_group(self, outcomes: list[RewardOutcome]) -> list[RewardOutcome]:
        """Apply the reward classes' ``post_process_scores`` to one complete ``uid`` group."""
        return self.manager.post_process_group(outcomes)

    def has_post_process(self) -> bool:
        return self.manager.has_post_process

    def info(self) -> dict[str, Any]:
        """Where this worker runs; also the dispatcher's liveness probe, so it stays cheap and unlogged."""
        import ray

        ctx = ray.get_runtime_context()
        return {
            "worker_index": self.worker_index,
            "node_id": ctx.get_node_id(),
            "pid": os.getpid(),
            "calls": self.calls,
            "accelerator_ids": ctx.get_accelerator_ids(),
            "placement_group_id": ctx.get_placement_group_id(),
        }


def _writable(record: dict[str, Any]) -> dict[str, Any]:
    """The record with its pixels writable, as a ``DataProto`` chunk gave them: Ray hands an array argument over as a
    read-only view of its buffer, and a reward function may change the image it is given."""
    pixels = record.get(PIXELS)
    if isinstance(pixels, np.ndarray) and not pixels.flags.writeable:
        record[PIXELS] = pixels.copy()
    return record


async def score_with_teacher(scoring, teacher: Teacher, trajectory: dict[str, Any]) -> RewardOutcome:
    """The reward outcome of ``scoring`` (a coroutine) with the teacher's velocities, the two run concurrently (the
    teacher in a thread); a teacher error fails the sample, naming it."""
    velocity = asyncio.to_thread(teacher.velocities, trajectory)
    outcome, v = await asyncio.gather(scoring, velocity, return_exceptions=True)
    if isinstance(outcome, BaseException):
        raise outcome
    if isinstance(v, BaseException):
        return RewardOutcome("failed", error=f"distillation teacher: {type(v).__name__}: {v}")
    outcome.teacher_velocity = v
    return outcome


def _device() -> str:
    """The devices Ray gave this worker (``GPU 0``), else ``cpu``."""
    import ray

    ids = ray.get_gpu_ids() if ray.is_initialized() else []
    return f"GPU {','.join(str(i) for i in ids)}" if ids else "cpu"
