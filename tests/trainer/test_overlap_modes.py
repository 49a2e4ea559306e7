"""One-step off-policy and the mini-batch update pipeline, checked on their timestamps (real Ray, in-process)."""

from __future__ import annotations

import json

import pytest
from helpers import SMALL_LORA

from omni_async.cluster import shutdown_ray
from omni_async.trainer.config import compose
from omni_async.trainer.loop import FlowGRPOTrainer
from omni_async.trainer.mode import PIPELINE

pytestmark = pytest.mark.slow  # training runs: not in the fast tier (pytest -m 'not slow')

SLOW = [
    "reward.custom_reward_function.path=pkg://omni_async.reward.scorers.simulated",
    "+reward.custom_reward_function.reward_kwargs.latency_scale=0.02",
]  # 20-800 ms per sample
SMALL = [
    "actor_rollout_ref.model.path=tiny:sd3",
    *SMALL_LORA,  # the hybrid layout's overlap modes generate from a LoRA snapshot (a full fine-tune is refused there)
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    "actor_rollout_ref.rollout.num_inference_steps=4",
    "actor_rollout_ref.rollout.height=32",
    "actor_rollout_ref.rollout.width=32",
    "actor_rollout_ref.rollout.algo.sde_window_range=[0,3]",
    "actor_rollout_ref.rollout.agent.max_batch_size=2",
    "trainer.logger=[jsonl]",
    "trainer.resume_mode=disable",
    "trainer.log_image_freq=-1",
    *SLOW,
]


@pytest.fixture
def trainer(tmp_path, request):
    (tmp_path / "train.jsonl").write_text(
        "".join(
            json.dumps({"prompt": f"p{i}", "data_source": "x", "reward_model": {"ground_truth": ""}}) + "\n"
            for i in range(16)
        )
    )
    shutdown_ray()
    cfg = compose(
        [f"data.train_files={tmp_path}/train.jsonl", f"trainer.run_dir={tmp_path}/run", *SMALL, *request.param]
    )
    t = FlowGRPOTrainer(cfg)
    t.sync_weights(0)
    yield t
    t.close()
    shutdown_ray()


def spans(timeline, phase):
    return [(p["start"], p["end"]) for p in timeline["trainer"] if p["phase"] == phase]


@pytest.mark.parametrize(
    "trainer",
    [
        ["async_reward.one_step_off_policy=true", "trainer.total_training_steps=3"],
        ["async_reward.one_step_off_policy=true", "trainer.total_training_steps=3", "reward.streaming=false"],
    ],
    indirect=True,
    ids=["stream", "sync_reward"],
)
def test_one_step_off_policy_overlaps_next_rollout_with_update_and_lags_by_one(trainer):
    rows, timelines = [], []
    for step in range(3):
        metrics, _ = trainer.train_step(step)
        rows.append(metrics)
        timelines.append(trainer.last_timeline)
    assert [r["async_reward/policy_version_lag"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["rollout/policy_version"] for r in rows] == [0.0, 0.0, 1.0]
    for k in range(2):
        update_end = max(end for _, end in spans(timelines[k], "update_actor"))
        next_rollout_start = min(s["gen_start"] for s in timelines[k + 1]["samples"])
        assert next_rollout_start < update_end  # step k+1's rollout ran while step k trained
    producer = trainer.agent.on_loop(lambda: (len(trainer.rollouter.live), trainer.rollouter.started))
    assert producer == (0, 3 * 4)  # every group started was trained: nothing generated past the last step


@pytest.mark.parametrize("trainer", [PIPELINE], indirect=True)
def test_pipeline_updates_before_the_last_reward_and_uses_every_group_once(trainer):
    trained_uids: list[list[str]] = []
    real_step = trainer.ops.optimizer_step

    def recording_step(minibatch, timer):  # the real optimizer step, with a record of which groups it trained
        trained_uids.append(sorted(set(minibatch.non_tensor_batch["uid"])))
        return real_step(minibatch, timer)

    trainer.ops.optimizer_step = recording_step
    metrics, samples = trainer.train_step(0)
    timeline = trainer.last_timeline
    first_update = min(start for start, _ in spans(timeline, "update_actor"))
    assert first_update < max(s["scored"] for s in timeline["samples"])
    used = [uid for mb in trained_uids for uid in mb]
    assert sorted(used) == sorted({s.uid for s in samples}) and len(used) == 4
    assert all(len(mb) == 1 for mb in trained_uids)  # ppo_mini_batch_size=1 prompt
    assert metrics["actor/grad_norm"] > 0 and metrics["rollout/policy_version"] == 0.0


@pytest.mark.parametrize(
    "trainer",
    [["trainer.total_training_steps=2", "trainer.log_image_freq=1", "trainer.log_timeline_freq=1"]],
    indirect=True,
)
def test_pictures_are_drawn_off_the_training_path(trainer, monkeypatch):
    """The timeline and the sample grid are drawn by a background thread: the step loop hands them over and goes on
    (each drawing here is slowed to 2 s and the second step starts before the first step's pictures exist); fit
    returns once every picture is written."""
    import threading
    import time

    from omni_async.trainer import loop

    drawn: list[tuple[str, float]] = []
    started: list[float] = []
    real_timeline, real_step = loop.save_timeline, trainer.train_step

    def slow_timeline(run_dir, record):
        time.sleep(2.0)
        drawn.append((threading.current_thread().name, time.time()))
        return real_timeline(run_dir, record)

    def timed_step(step):
        started.append(time.time())
        return real_step(step)

    monkeypatch.setattr(loop, "save_timeline", slow_timeline)
    trainer.train_step = timed_step
    trainer.fit()
    assert [name.startswith("pictures") for name, _ in drawn] == [True, True]
    assert started[1] < drawn[0][1]  # step 2 did not wait for step 1's timeline
    run = trainer.run_dir
    assert sorted(p.name for p in (run / "timeline").glob("*.png")) == ["step_0001.png", "step_0002.png"]
    assert len(list((run / "samples").glob("*.png"))) == 2
