"""Fully async training (``async_reward.fully_async``): verl's ``async_training.*`` keys and verl v1 / verl-omni's
``separate_async`` spelling, and a real run on a rollout pool with a trainer slower than the rollout.

The rollouter's scheduling is stressed over hundreds of steps in tests/agent_loop/test_rollouter.py; here the same
code runs with real rollout workers, reward workers and trainer ranks."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import ray
import torch
from helpers import SMALL_LORA, record_trained_uids, train_step_killing_rollout, write_prompts

from omni_async.agent_loop.draws import sample_seed
from omni_async.cluster import shutdown_ray
from omni_async.trainer.config import (
    ConfigError,
    compose,
    interrupts_at_sync,
    total_training_steps,
    validate,
)
from omni_async.trainer.mode import PIPELINE, mode_of

POOL = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1"]
FULLY_ASYNC = [*POOL, "async_reward.fully_async=true"]
QUIET = ["trainer.log_image_freq=-1", "trainer.log_timeline_freq=-1"]


# The image config's keys here were written with LoRA (rank 8, alpha 16: this project's earlier default). verl's default
# rank 0, a full fine-tune, is refused in the hybrid layout's overlap modes and ships to a rollout pool only with
# checkpoint_engine nccl; a test of that passes lora_rank=0 itself.
def valid(*overrides: str, config_name: str = "flowgrpo_trainer"):
    lora = SMALL_LORA if config_name == "flowgrpo_trainer" else []
    return validate(compose(["data.train_files=x.jsonl", *lora, *overrides], config_name=config_name))


# ---- keys (no Ray) ---------------------------------------------------------------------------------------------
def test_verl_fully_async_keys_and_verl_omni_separate_async_compose():
    # verl's fully-async recipe keys: 8 prompts, updates of 2 x 2 groups, a sync every 2 updates, threshold 0.5
    cfg = valid(
        *FULLY_ASYNC,
        "async_training.staleness_threshold=0.5",
        "async_training.require_batches=2",
        "async_training.trigger_parameter_sync_step=2",
        "rollout.total_rollout_steps=8",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    )
    m = mode_of(cfg)
    assert m.groups_per_step == 4 and total_training_steps(cfg, 100) == 2 and m.sync_period == 2
    assert (m.cap, m.bound) == (12, 2)  # floor(1.5 x 2 x 2 x 2) groups per window; ceil(12 / 4) - 1
    assert cfg.async_training.partial_rollout  # verl's default, an image run: kept
    # null total_rollout_steps: the lock-step run's prompts (4 steps x 4), in updates of 2 groups
    assert total_training_steps(valid(*FULLY_ASYNC), 100) == 8
    # verl-omni's separate-async script: its overrides carry over, the version span tightens the bound
    omni = valid(
        *POOL,
        "trainer.use_v1=true",
        "trainer.v1.trainer_mode=separate_async",
        "trainer.v1.separate_async.parameter_sync_step=1",
        "trainer.v1.sampler.max_off_policy_threshold=2",
        "trainer.v1.sampler.max_off_policy_strategy=drop",
        "async_training.staleness_threshold=3",
    )
    assert omni.async_reward.fully_async and (mode_of(omni).cap, mode_of(omni).bound) == (4, 1)  # span <= 2: lag <= 1
    # verl-omni's on-policy recipe (threshold 1, sync every update) is synchronous
    on_policy = valid(
        *POOL,
        "trainer.v1.trainer_mode=separate_async",
        "trainer.v1.separate_async.parameter_sync_step=1",
        "trainer.v1.sampler.max_off_policy_threshold=1",
    )
    assert mode_of(on_policy).bound == 0
    text = valid(
        *FULLY_ASYNC,
        "async_training.partial_rollout=false",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        config_name="grpo_text_trainer",
    )
    assert text.async_reward.fully_async


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        (
            ["async_reward.fully_async=true", "actor_rollout_ref.model.lora_rank=0"],
            "actor_rollout_ref.hybrid_engine",
            "lora_rank > 0",
        ),
        (
            [*FULLY_ASYNC, "async_reward.one_step_off_policy=true"],
            "async_reward.one_step_off_policy",
            "drop async_reward.one_step_off_policy=true",
        ),
        ([*FULLY_ASYNC, "algorithm.rollout_correction.bypass_mode=false"], "bypass_mode", "bypass_mode=true"),
        ([*FULLY_ASYNC, "async_training.staleness_threshold=-1"], "staleness_threshold", "synchronous"),
        ([*FULLY_ASYNC, "async_training.require_batches=0"], "require_batches", "default 1"),
        ([*FULLY_ASYNC, "rollout.total_rollout_steps=1"], "rollout.total_rollout_steps", "raise it"),
        (
            [
                *FULLY_ASYNC,
                "async_training.trigger_parameter_sync_step=3",
                "trainer.v1.sampler.max_off_policy_threshold=2",
            ],
            "max_off_policy_threshold",
            "set it >= 3",
        ),
        ([*FULLY_ASYNC, "trainer.v1.sampler.max_off_policy_strategy=keep"], "max_off_policy_strategy", "drop or wait"),
        ([*POOL, "trainer.v1.sampler.max_off_policy_threshold=2"], "max_off_policy_threshold", "fully_async=true"),
        (
            [*POOL, "trainer.v1.trainer_mode=separate_async", "async_reward.one_step_off_policy=true"],
            "trainer.v1.trainer_mode",
            "drop async_reward.one_step_off_policy",
        ),
        ([*FULLY_ASYNC, "trainer.v1.trainer_mode=sync"], "trainer.v1.trainer_mode", "drop one of them"),
    ],
)
def test_refused_fully_async_combinations_name_the_fix(overrides, key, fix):
    with pytest.raises(ConfigError, match=key) as e:
        valid(*overrides)
    assert fix in str(e.value)


def test_the_modes_are_settings_that_combine():
    """One producer makes every mode, so settings that were separate modes combine: fully async on the hybrid layout
    (verl v1's colocate_async), with the mini-batch pipeline, or with a sync reward."""
    hybrid = mode_of(valid("async_reward.fully_async=true"))
    assert hybrid.name == "fully_async" and not hybrid.lock_step and hybrid.overlaps_update
    colocate = valid("trainer.v1.trainer_mode=colocate_async")
    assert colocate.async_reward.fully_async and mode_of(colocate) == hybrid
    piped = mode_of(valid(*FULLY_ASYNC, *PIPELINE))
    assert piped.pipelined and not piped.lock_step
    assert not mode_of(valid(*FULLY_ASYNC, "reward.streaming=false")).streaming
    with pytest.raises(ConfigError, match="colocate_async generates on the devices that train"):
        valid(*POOL, "trainer.v1.trainer_mode=colocate_async")
    presets = {
        "sync": ["reward.streaming=false"],
        "stream": [],
        "stream+pipeline": PIPELINE,
        "stream+one_step_off": ["async_reward.one_step_off_policy=true"],
        "all": [*PIPELINE, "async_reward.one_step_off_policy=true"],
        "sync+one_step_off": ["async_reward.one_step_off_policy=true", "reward.streaming=false"],
    }
    for name, overrides in presets.items():
        m = mode_of(valid(*overrides))
        assert m.name == name and m.lock_step and m.groups_per_step == 4  # data.train_batch_size
        off = "one_step_off" in name or name == "all"
        assert (m.cap, m.bound) == ((8, 1) if off else (4, 0))  # one draw ahead, trained one version late


def test_text_partial_rollout_is_accepted_and_refused_only_for_a_vllm_rollout():
    """verl's default partial_rollout=true runs for text (interrupted responses continue under the new weights);
    only the vLLM rollout, whose server requests cannot be continued here, is refused, naming the fix."""
    text = valid(
        *FULLY_ASYNC, "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", config_name="grpo_text_trainer"
    )
    assert text.async_training.partial_rollout and interrupts_at_sync(text)
    assert not interrupts_at_sync(valid(*FULLY_ASYNC))  # images: never interrupted, whatever partial_rollout says
    off = [
        *FULLY_ASYNC,
        "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        "async_training.partial_rollout=false",
    ]
    assert not interrupts_at_sync(valid(*off, config_name="grpo_text_trainer"))
    vllm = [*FULLY_ASYNC, "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.model.lora_rank=8"]
    with pytest.raises(ConfigError, match="async_training.partial_rollout") as e:
        valid(*vllm, config_name="grpo_text_trainer")
    assert "partial_rollout=false" in str(e.value) and "rollout.name=transformers" in str(e.value)
    assert not valid(
        *vllm, "async_training.partial_rollout=false", config_name="grpo_text_trainer"
    ).async_training.partial_rollout


# ---- on Ray ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_image_run_with_a_slow_trainer_and_a_killed_rollout_worker_stays_in_bounds_trains_every_group_once(trainers):
    """Staleness 1, a sync every 2 updates of 1 group (K=2, n=1): at most floor(2 x 2) = 4 groups started per window
    and a lag of at most ceil(4 / 1) - 1 = 3 steps. Each update is slowed by 1 s, far longer than a group takes to
    generate, so the rollouter runs into both bounds. verl's default partial_rollout=true on images. The rollout
    worker is killed during the first step."""
    t = trainers(
        *FULLY_ASYNC, *QUIET, "async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=2"
    )
    assert (t.mode.cap, t.mode.bound, t.total_steps) == (4, 3, 8)
    trained = record_trained_uids(t.ops)
    real_step = t.ops.optimizer_step

    def slow_step(minibatch, timer):
        time.sleep(1.0)
        return real_step(minibatch, timer)

    t.ops.optimizer_step = slow_step
    # The rollout worker is killed (as kill -9) once its first batch is done: Ray restarts it, it gets the newest
    # weights and the requests it had are generated again, identical (same seed, window and weights version).
    replica = t.placement.rollout_workers[0]
    first_metrics, first_samples = train_step_killing_rollout(t, 0, replica)
    rows = [first_metrics]
    for s in first_samples:  # before the first sync (at step 2) the rollout still holds version 0
        again = ray.get(replica.generate.remote(s.row.prompt, s.seed, s.window))
        assert again.version == s.version == 0 and np.array_equal(again.result.pixels, s.result.pixels)
    for step in range(1, t.total_steps):
        metrics, samples = t.train_step(step)
        rows.append(metrics)
        assert len({s.uid for s in samples}) == 1 and len(samples) == 4  # one whole group per update
        assert all(s.version % 2 == 0 and s.version <= step for s in samples)  # weights of a sync at most K back
        assert step - min(s.version for s in samples) <= 3
        assert metrics["fully_async/rollouter/window"] <= 4
        assert metrics["fully_async/count/started_groups"] <= step + 1 + 4  # trained + at most one window ahead
    assert sum(r["rollout/regenerated"] for r in rows) >= 1
    lags = [r["training/off_policy/trajectory_staleness/max"] for r in rows]
    assert max(lags) == 3  # the slow trainer let the rollouter run to its bound, not past it
    # every group of the 4 draws of 2 prompts trained exactly once (all its 4 samples), none dropped
    assert sorted(trained) == sorted(f"{d}-{p}" for d in range(4) for p in range(2) for _ in range(4))
    assert len(trained) == 8 * 4
    assert rows[-1]["fully_async/count/dropped_stale_samples"] == 0
    assert max(r["fully_async/rollouter/window"] for r in rows) == 4  # it filled its window: paused at the cap
    assert all(r["actor/grad_norm"] > 0 for r in rows)


@pytest.mark.slow
def test_colocate_async_on_the_hybrid_layout_trains_every_group_once_within_the_bound(trainers):
    """verl v1's colocate_async: fully async on the devices that train (the hybrid layout; the rollout reads a LoRA
    snapshot of the synced version while the actor trains). Staleness 1, one group per update: at most 2 groups per
    window, lag <= 1; before each sync the trainer waits until the samples in flight are generated (the snapshot they
    read is about to change), so every sample is made by one version."""
    t = trainers(*QUIET, "trainer.v1.trainer_mode=colocate_async", "async_training.staleness_threshold=1")
    assert t.layout.name == "hybrid" and (t.mode.cap, t.mode.bound, t.total_steps) == (2, 1, 8)
    trained = record_trained_uids(t.ops)
    rows = []
    for step in range(t.total_steps):
        metrics, samples = t.train_step(step)
        rows.append(metrics)
        assert len({s.uid for s in samples}) == 1 and len(samples) == 4  # one whole group per update
        assert all(0 <= step - s.version <= 1 for s in samples)
        assert "timing_s/wait_next_rollout" in metrics  # the sync waited for the rollout to be idle
    assert max(r["training/off_policy/trajectory_staleness/max"] for r in rows) == 1  # it ran ahead, to the bound
    assert sorted(trained) == sorted(f"{d}-{p}" for d in range(4) for p in range(2) for _ in range(4))
    assert all(r["actor/grad_norm"] > 0 for r in rows)


@pytest.mark.slow
def test_resume_from_a_lock_step_checkpoint_of_earlier_releases_goes_on_with_the_next_draw(trainers):
    """Earlier releases wrote lock-step checkpoints with the step and the sampler state only (one draw per step, all of
    it trained). A fully async run resumed from one goes on with draw 1, the sampler as saved: the next prompts, and
    seeds and uids that step 0 did not use."""
    t = trainers(*FULLY_ASYNC, *QUIET, "trainer.resume_mode=auto", "trainer.total_training_steps=3")
    lock_step = t.sampler.next_batch()  # what that run's step 0 drew
    path = t._ckpt_dir(1)
    t.placement.actor_wg.save_checkpoint(str(path))
    (path / "trainer.json").write_text(json.dumps({"step": 1, "sampler": t.sampler.state_dict()}))
    t.sampler.load_state_dict({"epoch": 0, "position": 0})
    assert t.resume() == 1
    t.sync_weights(1)
    _, samples = t.train_step(1)
    assert {s.uid.split("-")[0] for s in samples} == {"1"}
    assert all(s.seed == sample_seed(int(t.cfg.trainer.seed), 1, s.index) for s in samples)
    assert not {s.row.prompt for s in samples} & {r.prompt for r in lock_step}


@pytest.mark.slow
@pytest.mark.parametrize(
    "modality", ["text"]
)  # images: test_kill_resume_overlap.py's fully async case (AWM, split layout)
def test_kill_9_of_the_trainer_then_resume_trains_every_group_once(tmp_path, modality):
    """The trainer process (driver, rollouter, message queue) and its Ray job's workers are killed with SIGKILL once its
    step-2 checkpoint exists, with scored groups queued and more generating (text: with verl's partial rollout, responses
    half generated); the resumed run makes the checkpoint's draws again and regenerates the unfinished groups from
    their seeds. Across the two runs every group is trained exactly once (the steps the kill lost are the killed
    run's steps after the checkpoint: they count as not trained)."""
    import os
    import subprocess
    import sys

    import logging_trainer
    from helpers import ROOT, SMALL_IMAGE_TRAINER
    from kill_resume import RUN_TAG, kill_run

    data = write_prompts(tmp_path / "train.jsonl", 8)
    run = tmp_path / "run"
    if modality == "image":
        base, config_name = [*SMALL_IMAGE_TRAINER, *FULLY_ASYNC, *QUIET], "flowgrpo_trainer"
    else:  # two responses per device batch: some are in flight at every sync, so partial rollout interrupts them
        base, config_name = [*TEXT_PARTIAL, "actor_rollout_ref.rollout.agent.max_batch_size=2"], "grpo_text_trainer"
    overrides = [
        f"data.train_files={data}",
        f"trainer.run_dir={run}",
        *base,
        "trainer.resume_mode=auto",
        "async_training.staleness_threshold=1",
        "trainer.total_training_steps=3",
        "trainer.save_freq=2",
        "trainer.save_interval_min=-1",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CONFIG_NAME": config_name}
    runner = [sys.executable, str(ROOT / "tests/trainer/logging_trainer.py")]
    logs = [tmp_path / "killed.log", tmp_path / "resumed.log"]
    killed = subprocess.Popen(
        [*runner, str(logs[0]), *overrides],
        env={**env, "SLOW_UPDATE_S": "1.5", RUN_TAG: str(tmp_path)},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ckpt = run / "checkpoints/step_000002/trainer.json"
    deadline = time.time() + 300
    while not ckpt.exists() and killed.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert ckpt.exists() and killed.poll() is None, "the run should be past its step-2 checkpoint and still running"
    position = json.loads(ckpt.read_text())  # the rollouter's position: draw, sampler, finished groups
    kill_run(killed, str(tmp_path))  # its process tree and its Ray job's workers, at once
    shutdown_ray()  # resumed by a fresh trainer in this process, as a restarted process would run it
    try:
        logging_trainer.run(str(logs[1]), overrides, config_name)
    finally:
        shutdown_ray()

    def rows(path):
        return [
            tuple(int(x) if i != 1 else x for i, x in enumerate(line.split())) for line in path.read_text().splitlines()
        ]

    first, second = rows(logs[0]), rows(logs[1])
    kept = [r for r in first if r[0] < 2]
    lost = [r for r in first if r[0] >= 2]
    assert {r[0] for r in second} == set(range(2, 6))  # resumed at step 2, ran to the end
    trained = [(uid, index) for _, uid, index, _ in kept + second]
    assert len(trained) == len(set(trained)) == 6 * 4  # every sample of every group once
    assert {uid for uid, _ in trained} == {f"{d}-{p}" for d in range(3) for p in range(2)}
    # the unfinished groups were regenerated with the same seeds (deterministic from (seed, draw, index))
    seeds = {(uid, index): seed for _, uid, index, seed in first + second}
    assert all(seeds[(uid, index)] == seed for _, uid, index, seed in lost)
    assert position["draw"] >= 0 and set(position["finished"]) >= {
        r[1] for r in kept if int(r[1][0]) >= position["draw"]
    }
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 7)) and metrics[-1][
        "fully_async/count/dropped_stale_samples"
    ] == 0


# ---- text with partial rollout (verl's default) ------------------------------------------------------------------
TEXT_PARTIAL = [
    *FULLY_ASYNC,
    *QUIET,
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    "actor_rollout_ref.rollout.response_length=32",
    # one response per device batch: generating a group takes longer than an update, so responses are on the device
    # at every weight sync and get interrupted (the situation partial rollout is for)
    "actor_rollout_ref.rollout.agent.max_batch_size=1",
    "actor_rollout_ref.actor.optim.lr=2e-3",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
    "reward.custom_reward_function.name=compute_score_digits",
    "async_training.staleness_threshold=1",
    "trainer.total_training_steps=3",  # 3 x 2 prompts: 6 updates of one group
    "trainer.logger=[jsonl]",
    "trainer.resume_mode=auto",
    "trainer.save_freq=-1",
    "trainer.save_interval_min=-1",
    "data.shuffle=false",
]


def _text_trainer(train_file, run_dir):
    from omni_async.trainer.loop import RLTrainer

    shutdown_ray()
    cfg = compose(
        [f"data.train_files={train_file}", f"trainer.run_dir={run_dir}", *TEXT_PARTIAL],
        config_name="grpo_text_trainer",
    )
    return RLTrainer(cfg)


def _close(trainer) -> None:
    trainer.close()  # idempotent (fit stops its rollouter and the agent loop itself)
    shutdown_ray()


def _record_batches(ops) -> dict:
    """Spy on ``StepOps.optimizer_step``: (uid, index) -> the trained row's (old_log_probs, token_versions)."""
    rows: dict = {}
    real_step = ops.optimizer_step

    def recording_step(minibatch, timer):
        b, nt = minibatch.batch, minibatch.non_tensor_batch
        for i, key in enumerate(zip(nt["uid"].tolist(), nt["index"].tolist(), strict=True)):
            assert key not in rows, f"{key} trained twice"
            rows[key] = (b["old_log_probs"][i].clone(), b["token_versions"][i].clone())
        return real_step(minibatch, timer)

    ops.optimizer_step = recording_step
    return rows


@pytest.mark.slow
def test_text_partial_rollout_per_token_versions_bound_and_resume(tmp_path):
    """Text, fully async, verl's default partial_rollout=true, staleness 1 and a sync after every update of one group
    (cap floor(2 x 1) = 2 groups per window, lag bound ceil(2 / 1) - 1 = 1). Responses in flight at a sync are
    interrupted and continued under the new weights: some trained responses hold tokens of two versions. Each
    token's rollout log-prob (pi_old, bypass mode) is the one its own version gives when recomputed, the batch
    carries each token's version, and the lag bound holds for the oldest token of every sample. After 3 updates the
    run is checkpointed (with responses in flight) and its rollouter stopped; the trainer resumes from the checkpoint
    with a fresh rollouter (what a restarted process does, without paying for a second Ray start here: the image test
    above kills the process), makes the draws again and regenerates the unfinished groups from their seeds: across
    both every group is trained once."""
    from omni_async.models.text_policy import TextPolicy, TextSamplingConfig

    data, run = write_prompts(tmp_path / "train.jsonl", 8), tmp_path / "run"
    t = _text_trainer(data, run)
    rank0 = t.placement.actor_wg.workers[0]
    weights = {0: ray.get(rank0.get_weights.remote())}
    real_sync = t.layout.sync

    def recording_sync(version, *args, **kwargs):
        real_sync(version, *args, **kwargs)
        weights[version] = ray.get(rank0.get_weights.remote())  # what the rollout workers hold from now on

    t.layout.sync = recording_sync
    real_step = t.ops.optimizer_step
    rows = _record_batches(t.ops)
    try:
        assert (t.mode.cap, t.mode.bound, t.total_steps) == (2, 1, 6)
        t.sync_weights(0)
        steps = [t.train_step(step) for step in range(3)]
        t.save_checkpoint(3)
        t.agent.call(t.rollouter.stop())  # the first run ends here, with groups in flight and scored ones not trained
        # resume: the checkpoint's draws made again, the unfinished groups regenerated, every group trained once
        t.rollouter, t.ops.optimizer_step = None, real_step
        rows_after = _record_batches(t.ops)
        t.fit()  # resume_mode=auto: the checkpoint's weights, sampler and rollouter position
    finally:
        _close(t)
    trained = [s for _, samples in steps for s in samples]
    for step, (metrics, samples) in enumerate(steps):
        assert len({s.uid for s in samples}) == 1 and len(samples) == 4  # one whole group per update
        assert all(step - s.version <= 1 for s in samples)  # the oldest token of every sample within the bound
        assert metrics["training/off_policy/trajectory_staleness_worst/max"] <= 1
        assert metrics["fully_async/count/dropped_stale_samples"] == 0
    spans = [s.version_span for s in trained]
    assert any(new > old for old, new in spans), spans  # responses continued across a sync
    assert sum(m["rollout/resumed"] for m, _ in steps) >= 1
    assert sum(m["fully_async/partial/total_partial_num"] for m, _ in steps) == sum(new > old for old, new in spans)

    # pi_old per token: the batch's old_log_probs and token_versions are the rollout's, token by token
    policy = TextPolicy("tiny:qwen2", TextSamplingConfig(response_length=32), lora_rank=0)
    recomputed: dict = {}
    for v in sorted({int(v) for s in trained for v in s.result.versions}):
        policy.load_weights_state_dict(weights[v])
        for s in trained:
            p, r = torch.tensor([s.result.prompt_ids]), torch.tensor([s.result.response_ids])
            with torch.no_grad():
                recomputed[(s.uid, s.index, v)] = policy.log_probs(p, torch.ones_like(p), r, torch.ones_like(r))[0]
    mixed = 0
    for s in trained:
        res, n = s.result, len(s.result.response_ids)
        old, versions = rows[(s.uid, s.index)]
        assert torch.equal(old[:n], res.log_probs) and torch.equal(versions[:n], res.versions)
        assert (versions[n:] == -1).all() and len(res.versions) == n
        own = torch.stack([recomputed[(s.uid, s.index, int(v))][t] for t, v in enumerate(res.versions)])
        assert torch.allclose(res.log_probs, own, atol=1e-4), (s.uid, s.index, (res.log_probs - own).abs().max())
        if res.versions.max() > res.versions.min():  # the newer part, scored by the older weights, differs
            mixed += 1
            newer = res.versions == res.versions.max()
            older = recomputed[(s.uid, s.index, int(res.versions.min()))]
            assert (res.log_probs - older)[newer].abs().max() > 1e-3
    assert mixed >= 1

    groups = sorted({uid for uid, _ in rows} | {uid for uid, _ in rows_after})
    assert not set(rows) & set(rows_after)
    assert len(rows) + len(rows_after) == 6 * 4 and groups == [f"{d}-{p}" for d in range(3) for p in range(2)]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [4, 5, 6]  # the resumed run's steps (the first run's were not logged)
    assert all(m["training/off_policy/trajectory_staleness_worst/max"] <= 1 for m in metrics)
    assert metrics[-1]["fully_async/count/dropped_stale_samples"] == 0
