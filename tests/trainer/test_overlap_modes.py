"""One-step off-policy and the mini-batch update pipeline on the hybrid layout, checked on their timestamps and on
the versions their samples were drawn with (real Ray, in-process)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import SMALL_LORA
from omegaconf import OmegaConf

from omni_async.cluster import shutdown_ray
from omni_async.modality import get_modality
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


# lr 3e-2: step 0's update visibly moves the adapter that step 1's rollout shares the device with.
ONE_STEP_OFF = [
    "async_reward.one_step_off_policy=true",
    "trainer.total_training_steps=3",
    "actor_rollout_ref.actor.optim.lr=3e-2",
]


@pytest.mark.parametrize(
    "trainer", [ONE_STEP_OFF, [*ONE_STEP_OFF, "reward.streaming=false"]], indirect=True, ids=["stream", "sync_reward"]
)
def test_one_step_off_policy_overlaps_next_rollout_with_update_lags_by_one_and_reads_the_version_that_made_it(
    trainer,
):
    """On the hybrid layout, step k+1's samples generate while step k trains, on the same device. They must be
    exactly the samples of the version they carry: the rollout reads a snapshot of the adapter, not the weights in
    training."""
    rows, timelines, drawn = [], [], []
    for step in range(3):
        metrics, samples = trainer.train_step(step)
        rows.append(metrics)
        timelines.append(trainer.last_timeline)
        drawn.append(samples)
    assert [r["async_reward/policy_version_lag"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["rollout/policy_version"] for r in rows] == [0.0, 0.0, 1.0]
    for k in range(2):
        update_end = max(end for _, end in spans(timelines[k], "update_actor"))
        next_rollout_start = min(s["gen_start"] for s in timelines[k + 1]["samples"])
        assert next_rollout_start < update_end  # step k+1's rollout ran while step k trained
    producer = trainer.agent.on_loop(lambda: (len(trainer.rollouter.live), trainer.rollouter.started))
    assert producer == (0, 3 * 4)  # every group started was trained: nothing generated past the last step

    # Step 1's samples, drawn while step 0 trained, are version 0's: the model as built (LoRA B starts at zero).
    # Rebuilt here, with no Ray, it gives their trajectories the log-probs the rollout recorded.
    assert rows[0]["actor/grad_norm"] > 0 and len({s.window for s in drawn[1]}) > 1  # each sample its own window
    modality = get_modality("image")
    policy = modality.build_policy(
        OmegaConf.to_container(trainer.cfg.actor_rollout_ref.model, resolve=True),
        vars(modality.sampling_config(trainer.cfg)),
        "cpu",
    )
    batch = trainer.ops.build_batch(drawn[1])
    with torch.no_grad():
        recomputed = modality.log_probs(policy, batch)
    torch.testing.assert_close(recomputed, batch.batch["old_log_probs"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "trainer",
    [[*PIPELINE, "trainer.total_training_steps=2", "trainer.log_image_freq=1", "trainer.log_timeline_freq=1"]],
    indirect=True,
)
def test_pipeline_updates_before_the_last_reward_uses_every_group_once_and_pictures_are_drawn_off_the_path(
    trainer, monkeypatch
):
    """The mini-batch pipeline's first update starts before the step's last reward is in, and trains each group once.
    The run's pictures (timeline and sample grid) are drawn by a background thread: the step loop hands them over
    and goes on (each drawing here is slowed to 2 s and the second step starts before the first step's pictures
    exist); fit returns once every picture is written."""
    import threading
    import time

    from omni_async.trainer import loop

    trained_uids: list[list[str]] = []
    real_opt_step = trainer.ops.optimizer_step

    def recording_step(minibatch, timer):  # the real optimizer step, with a record of which groups it trained
        trained_uids.append(sorted(set(minibatch.non_tensor_batch["uid"])))
        return real_opt_step(minibatch, timer)

    drawn: list[tuple[str, float]] = []
    started: list[float] = []
    steps: list[tuple[dict, list, dict, int]] = []  # metrics, samples, timeline, mini-batches trained so far
    real_timeline, real_step = loop.save_timeline, trainer.train_step

    def slow_timeline(run_dir, record):
        time.sleep(2.0)
        drawn.append((threading.current_thread().name, time.time()))
        return real_timeline(run_dir, record)

    def timed_step(step):
        started.append(time.time())
        metrics, samples = real_step(step)
        steps.append((metrics, samples, trainer.last_timeline, len(trained_uids)))
        return metrics, samples

    trainer.ops.optimizer_step = recording_step
    monkeypatch.setattr(loop, "save_timeline", slow_timeline)
    trainer.train_step = timed_step
    trainer.fit()

    metrics, samples, timeline, n_trained = steps[0]
    first_update = min(start for start, _ in spans(timeline, "update_actor"))
    assert first_update < max(s["scored"] for s in timeline["samples"])
    used = [uid for mb in trained_uids[:n_trained] for uid in mb]
    assert sorted(used) == sorted({s.uid for s in samples}) and len(used) == 4
    assert all(len(mb) == 1 for mb in trained_uids)  # ppo_mini_batch_size=1 prompt
    assert metrics["actor/grad_norm"] > 0 and metrics["rollout/policy_version"] == 0.0

    assert [name.startswith("pictures") for name, _ in drawn] == [True, True]
    assert started[1] < drawn[0][1]  # step 2 did not wait for step 1's timeline
    run = trainer.run_dir
    assert sorted(p.name for p in (run / "timeline").glob("*.png")) == ["step_0001.png", "step_0002.png"]
    assert len(list((run / "samples").glob("*.png"))) == 2
