"""The GPU tier (issue 49): the product's Ray paths on one CUDA device, each asserting what its CPU twin asserts.

Run on a GPU machine by ``bash scripts/gpu_kit.sh run tier`` (or ``pytest -m gpu tests/gpu``); without CUDA every
test here is skipped, so the CPU suite only collects them. On a CUDA machine the run's Ray cluster detects the real
devices (``tests/conftest.py``), Ray hands each actor/rollout worker its device, the worker puts the model on it
(``cluster.configure_worker``) and ``model_dtype: null`` makes the frozen weights bf16 there. So the CPU twins below
run unchanged (the same function, collected here as well): a rollout worker killed and restarted with its requests
generated again (``test_reliability``), a checkpoint saved and resumed through the entry point
(``test_sync_trainer``), fully async training on the device that trains (``test_fully_async``), a reward-loop worker
beside the actor rank on half of the same device (``reward.reward_model.colocate_with_actor``:
``tests/reward/test_reward_beside_actor.py``). The tests written here check what only a device shows: the hybrid
worker of each modality generates and updates in bf16 with fp32 masters and fp32 log-probs, its first update scoring
its own samples at ratio 1 (nothing clipped at clip_ratio 1e-5), the split layout's replica beside the actor on a
share of the same device, taking the weight push, and the trainer's reward-loop worker beside its actor rank on that
device while a step trains.
"""

from __future__ import annotations

import math
import sys

import pytest
import ray
import ray.cloudpickle
import torch
from helpers import SMALL_IMAGE_TRAINER, Trainers, write_prompts

# The CPU twins, collected in this module as well, so its marks below apply to them here.
from test_fully_async import test_colocate_async_on_the_hybrid_layout_trains_every_group_once_within_the_bound  # noqa: F401
from test_reliability import test_rollout_worker_killed_mid_step_regenerates_the_same_samples  # noqa: F401
from test_reward_beside_actor import test_reward_worker_sits_beside_the_actor_on_a_share_of_its_device  # noqa: F401
from test_sync_trainer import test_sync_run_then_kill_and_resume_gives_same_next_step  # noqa: F401
from test_text_mode import DIGITS, write_arith
from test_text_mode import SMALL as SMALL_TEXT_TRAINER

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU tier: needs a CUDA device (scripts/gpu_kit.sh)"),
]

# One optimizer step per training step (a mini-batch = the step's prompts), so the step's ratio is the first update's;
# (config, overrides, largest |ratio_mean - 1| of that update).
FIRST_UPDATE = {
    # Images: in the SDE window rollout, recompute and update give the transformer the same shapes (one sample per
    # call), so in bf16 they agree and nothing is clipped at clip_ratio 1e-5 (docs/gpu_and_memory.md).
    "image": (
        "flowgrpo_trainer",
        [
            *SMALL_IMAGE_TRAINER,
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.diffusion_loss.clip_ratio=1e-5",
            "reward.streaming=true",
        ],
        1e-5,
    ),
    # Text: the HF rollout's incremental decode and the update's full forward differ in bf16 (0.07-0.08 per token
    # measured on an H200: docs/gpu_and_memory.md), so verl's clip 0.2 and a mean ratio near 1, not a 1e-5 clip.
    "text": (
        "grpo_text_trainer",
        [
            *SMALL_TEXT_TRAINER,
            *DIGITS,  # a reward that differs within a group from the first step (gsm8k's is 0 for all of them)
            "actor_rollout_ref.model.lora_rank=8",  # the text default is a full fine-tune; LoRA as the image's
            "actor_rollout_ref.model.lora_alpha=16",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            # pi_old = the rollout's log-probs (lock-step's default recomputes it, which would make the ratio 1 by
            # construction): the check is the rollout against the update
            "algorithm.rollout_correction.bypass_mode=true",
        ],
        0.05,
    ),
}


# Ray workers cannot import this test module: functions sent to them from here (worker_report) travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def worker_report(self) -> dict:
    """Run inside an actor worker or rollout replica (``__ray_call__``): where its model lives and in what dtypes."""
    policy = self.policy
    module = policy.transformer if hasattr(policy, "transformer") else policy.model
    named = list(module.named_parameters())
    return {
        "device": str(named[0][1].device),
        "base": sorted({str(p.dtype) for n, p in named if ".lora_" not in n}),  # the frozen weights
        "masters": sorted({str(p.dtype) for p in policy.trainable_parameters()}),  # what the optimizer steps
    }


@pytest.fixture
def make(tmp_path):
    made: list[Trainers] = []

    def build(kind: str, *overrides: str):
        config_name, base, _ = FIRST_UPDATE[kind]
        train = write_arith(tmp_path / "arith") / "train.jsonl" if kind == "text" else None
        made.append(Trainers(train or write_prompts(tmp_path / "train.jsonl", 8), tmp_path, base, config_name))
        return made[-1](*overrides)

    yield build
    for trainers in made:
        trainers.close()


@pytest.mark.parametrize("kind", list(FIRST_UPDATE))
def test_hybrid_worker_generates_and_updates_in_bf16_and_its_first_update_scores_ratio_1(make, kind):
    """CPU twins: ``tests/models/test_bf16.py`` (the rollout's log-prob is the update's first forward in bf16, ratio
    1, nothing clipped) and ``tests/trainer/test_device_placement.py`` (generate + update with the model on a device),
    here through Ray on one CUDA device, image and text (text: within its bf16 decode distance, see FIRST_UPDATE)."""
    t = make(kind)
    assert t.layout.name == "hybrid"
    report = ray.get(t.placement.actor_wg.workers[0].__ray_call__.remote(worker_report))
    assert report["device"].startswith("cuda")
    assert report["base"] == ["torch.bfloat16"] and report["masters"] == ["torch.float32"]
    metrics, samples = t.train_step(0)
    assert all(s.outcome.ok for s in samples) and all(s.result.log_probs.dtype == torch.float32 for s in samples)
    assert metrics["actor/pg_clipfrac"] == 0.0  # images at clip_ratio 1e-5, text at 0.2
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=FIRST_UPDATE[kind][2])
    assert metrics["actor/grad_norm"] > 0 and all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))
    _, again = t.train_step(1)  # the updated policy generates the next step on the device
    assert all(s.version == 1 for s in again)


def test_split_replica_shares_the_device_and_takes_the_weight_push(make):
    """CPU twin: the split half of ``tests/trainer/test_hybrid.py`` (rank 0 ships the weights at the first sync and
    after every update; the step's samples come from the version pushed before it), here with the actor and its
    rollout replica on shares of one CUDA device."""
    t = make("image", "actor_rollout_ref.hybrid_engine=false")
    assert t.layout.name == "split"
    actor, replica = t.placement.actor_wg.workers[0], t.placement.rollout_workers[0]
    reports = ray.get([actor.__ray_call__.remote(worker_report), replica.__ray_call__.remote(worker_report)])
    assert reports[0]["device"] == reports[1]["device"] and reports[0]["device"].startswith("cuda")
    assert reports[1]["base"] == ["torch.bfloat16"]
    assert ray.get(actor.__ray_call__.remote(lambda self: ray.get_gpu_ids())) == ray.get(
        replica.__ray_call__.remote(lambda self: ray.get_gpu_ids())
    )
    steps = [t.train_step(step) for step in range(2)]
    assert ray.get(actor.stats.remote())["weights_shipped"] == 3
    assert [m["rollout/policy_version"] for m, _ in steps] == [0.0, 1.0]
    assert all(s.version == 1 and s.outcome.ok for s in steps[1][1])


def test_reward_worker_beside_the_actor_shares_its_device_while_a_step_trains(make):
    """CPU twin: ``tests/reward/test_reward_beside_actor.py`` (the actor rank and the reward-loop worker on one
    device, half each, in Ray's accounting); here the trainer itself with ``reward.reward_model.colocate_with_actor``:
    its actor rank's model on the CUDA device, its reward-loop worker on the same device, a step trained with every
    sample scored there."""
    t = make("image", "reward.reward_model.colocate_with_actor=true")
    actor, reward = t.placement.actor_wg.workers[0], t.reward.workers[0]
    ids = ray.get([w.__ray_call__.remote(lambda self: ray.get_gpu_ids()) for w in (actor, reward)])
    assert ids[0] == ids[1] and len(ids[0]) == 1
    shares = ray.get(
        [
            w.__ray_call__.remote(lambda self: ray.get_runtime_context().get_assigned_resources())
            for w in (actor, reward)
        ]
    )
    assert [sum(v for k, v in r.items() if k.startswith("GPU")) for r in shares] == pytest.approx([0.5, 0.5], abs=1e-3)
    assert ray.get(actor.__ray_call__.remote(worker_report))["device"].startswith("cuda")
    metrics, samples = t.train_step(0)
    assert all(s.outcome.ok for s in samples) and metrics["actor/grad_norm"] > 0
