"""Reward-loop worker: a Ray actor that scores one-row ``DataProto`` chunks with the reward manager.

Its API is verl's reward loop's: ``compute_score(data) -> {"reward_score": float, "reward_extra_info": dict}``.
The manager (and whatever engine its functions load: an OCR model, a judge, an HTTP client) is built once per
worker, so a worker on the dedicated reward pool keeps its model resident between steps. The actor is async:
one worker scores many samples at once (sync functions run in its thread pool, ``async def`` ones on its loop),
up to the dispatcher's per-worker in-flight limit.

A failure is never a fake score: ``reward_score`` is ``None`` and ``reward_extra_info`` carries
``reward_status`` (``failed`` | ``timeout``) and ``reward_error``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from omegaconf import OmegaConf
from verl import DataProto

from omni_async.reward.manager import RewardManager, RewardOutcome

# Per-sample fields a reward function may see; everything else (trajectory latents, embeddings) stays behind.
REWARD_FIELDS = ("prompt", "data_source", "ground_truth", "extra_info", "uid")


def sample_to_proto(sample: dict[str, Any]) -> DataProto:
    """The minimal one-row chunk sent to a reward worker: uint8 ``pixels`` [1, (T,) H, W, 3] and the text fields."""
    import torch

    non_tensors = {}
    for key in REWARD_FIELDS:
        col = np.empty(1, dtype=object)
        col[0] = sample.get(key)
        non_tensors[key] = col
    tensors = {"pixels": torch.tensor(np.asarray(sample["image"]))[None]} if "image" in sample else {}
    if "response" in sample:
        non_tensors["response"] = np.array([sample["response"]], dtype=object)
    return DataProto.from_dict(tensors=tensors or None, non_tensors=non_tensors)


def proto_to_sample(data: DataProto) -> dict[str, Any]:
    if len(data) != 1:
        raise ValueError(f"a reward-loop worker scores one sample per call, got a chunk of {len(data)} rows")
    sample = {key: data.non_tensor_batch[key][0] for key in data.non_tensor_batch}
    if data.batch is not None and "pixels" in data.batch.keys():
        sample["image"] = data.batch["pixels"][0].numpy()
    return sample


def outcome_to_result(out: RewardOutcome) -> dict[str, Any]:
    info = dict(out.extra)
    info.update(reward_status=out.status, reward_error=out.error, reward_compute_s=out.compute_s,
                reward_parts=dict(out.parts))
    return {"reward_score": out.score if out.ok else None, "reward_extra_info": info}


def result_to_outcome(result: dict[str, Any]) -> RewardOutcome:
    info = dict(result["reward_extra_info"])
    return RewardOutcome(status=info.pop("reward_status"), score=result["reward_score"], error=info.pop("reward_error"),
                         compute_s=float(info.pop("reward_compute_s")), parts=info.pop("reward_parts"), extra=info)


class RewardLoopWorker:
    def __init__(self, reward_cfg: dict[str, Any], worker_index: int = 0):
        self.worker_index = worker_index
        self.manager = RewardManager(OmegaConf.create(reward_cfg))
        self.calls = 0

    async def compute_score(self, data: DataProto) -> dict[str, Any]:
        """Score one sample; never raises for a bad sample or a failing function (the outcome says so)."""
        self.calls += 1
        return outcome_to_result(await self.manager.score(proto_to_sample(data)))

    def post_process_group(self, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Apply the reward classes' ``post_process_scores`` to one complete ``uid`` group."""
        outcomes = self.manager.post_process_group([result_to_outcome(r) for r in results])
        return [outcome_to_result(o) for o in outcomes]

    def has_post_process(self) -> bool:
        return self.manager.has_post_process

    def info(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"worker_index": self.worker_index, "node_id": ctx.get_node_id(), "pid": os.getpid(),
                "calls": self.calls, "accelerator_ids": ctx.get_accelerator_ids(),
                "placement_group_id": ctx.get_placement_group_id()}
