"""The kill-and-resume harness of ``test_kill_resume_*.py``. Exactly-once training across a real kill: the trainer process is killed with SIGKILL at a named point of a step
(mid reward -- with samples still generating in the streaming modes --, mid update, mid checkpoint write), then run
again with ``trainer.resume_mode=auto``. Across the two runs every group is trained exactly once (the killed run's
steps after its last complete checkpoint count as not trained), the metrics hold one row per step, and a kill during
a checkpoint's write resumes from the previous complete checkpoint. One case per mode, layout and training method:
the kill points are spread over them (each point's code is the same in every mode); the cases are in two modules so
that the test session's two workers share them.

The fully async kill (partial rollout, text) is in ``test_fully_async.py``. Both runs join the test session's Ray
cluster (``RAY_ADDRESS``), as ``python -m omni_async.trainer.main`` joins a running cluster, instead of the killed run
starting one of its own (~15-20 s on a 2-core box): the kill takes the killed run's process tree and every process of
its Ray job at once, as a machine's crash would, so none of its actors outlives it until Ray notices (:func:`kill_run`).
The resumed run is a fresh trainer in the test's process (``logging_trainer.run``), without a second interpreter's
start and imports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import logging_trainer
import psutil
import torch
from helpers import ROOT, SMALL_IMAGE_TRAINER, TEST_REWARDS, write_prompts

from omni_async.cluster import shutdown_ray

QUIET = ["trainer.log_image_freq=-1", "trainer.log_timeline_freq=-1", "trainer.save_interval_min=-1"]
POOL = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1"]
SPLIT = ["actor_rollout_ref.hybrid_engine=false"]
IMAGE = [*SMALL_IMAGE_TRAINER, "actor_rollout_ref.actor.ppo_mini_batch_size=2"]  # one optimizer step per step
TEXT = [
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.rollout.response_length=8",
    "data.shuffle=false",
    "trainer.logger=[jsonl]",
]
STEPS = 2  # 2 prompts x 4 samples a step; a checkpoint after every step; the kills are in the last step
# Offline Diffusion-DPO (no rollout): verl-omni's OfflineDPODataset rows, 2 pairs a step, each a group of 2 samples
OFFLINE_DPO = [
    "algorithm.trainer_type=direct_preference",
    "algorithm.sample_source=offline",
    "algorithm.paired_preference=true",
    "actor_rollout_ref.model.algorithm=dpo",
    "actor_rollout_ref.model.model_type=diffusion_dpo_model",
    "actor_rollout_ref.actor.diffusion_loss.loss_mode=dpo",
    "actor_rollout_ref.actor.diffusion_loss.dpo_beta=100.0",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    f"data.train_files={ROOT / 'examples/data/offline_dpo/train.parquet'}",  # 4 pairs: STEPS x 2, one epoch
]
# A case: (config, overrides, kill point, step of the kill (0-based)); the reward point kills at the first reward call
# of that step (one reward worker; the step's draw after the earlier steps' 8 samples each).


RUN_TAG = "OMNI_ASYNC_TEST_RUN_TAG"  # an OMNI_ASYNC_* variable: the job's runtime env hands it to its Ray workers


def kill_run(proc: subprocess.Popen, tag: str) -> int:
    """SIGKILL the run ``proc`` started with ``$OMNI_ASYNC_TEST_RUN_TAG=tag``: its process tree and, at once, its Ray
    job's workers on a cluster it joined (they carry the tag in their environment). Returns how many of those
    workers were killed."""
    family = psutil.Process(proc.pid).children(recursive=True)
    mine = {p.pid for p in family} | {proc.pid}
    workers = []
    for p in psutil.process_iter():
        try:
            if p.pid not in mine and p.environ().get(RUN_TAG) == tag:
                workers.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    os.killpg(proc.pid, signal.SIGKILL)
    for p in family + workers:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(30)
    return len(workers)


def _rows(path) -> list[tuple[int, str, int, int]]:
    if not path.exists():
        return []
    return [(int(s), uid, int(i), int(seed)) for s, uid, i, seed in (x.split() for x in path.read_text().splitlines())]


def kill_then_resume(tmp_path, case: str, config_name: str, base: list[str], point: str, at: int) -> None:
    """Run ``base`` to ``STEPS`` steps, kill it at ``point`` of step ``at``, resume it, and assert exactly-once."""
    offline = "algorithm.sample_source=offline" in base  # its pairs are its data: no prompts
    group = 2 if offline else 4  # samples per group: a pair, or a prompt's 4 samples
    data = [] if offline else [f"data.train_files={write_prompts(tmp_path / 'train.jsonl', 2 * STEPS)}"]
    run, ready = tmp_path / "run", tmp_path / "ready"
    overrides = [
        *data,
        f"trainer.run_dir={run}",
        *base,
        *QUIET,
        f"reward.custom_reward_function.path={TEST_REWARDS}",
        "reward.custom_reward_function.name=blocks_after",
        "reward.num_workers=1",
        "trainer.resume_mode=auto",
        f"trainer.total_training_steps={STEPS}",
        "trainer.save_freq=1",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CONFIG_NAME": config_name}
    runner = [sys.executable, str(ROOT / "tests/trainer/logging_trainer.py")]
    logs = [tmp_path / "killed.log", tmp_path / "resumed.log"]
    kill_env = {"KILL_AT": f"{point}:{at}", "KILL_READY": str(ready)}
    if point == "reward":
        kill_env = {"OMNI_ASYNC_TEST_KILL_AFTER": str(8 * at), "OMNI_ASYNC_TEST_KILL_READY": str(ready)}
    killed = subprocess.Popen(
        [*runner, str(logs[0]), *overrides],
        env={**env, **kill_env, RUN_TAG: str(tmp_path)},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "killed.err", "w"),  # noqa: SIM115 -- the child's, closed with it
    )
    deadline = time.time() + 300
    while not ready.exists() and killed.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert ready.exists() and killed.poll() is None, (tmp_path / "killed.err").read_text()[-3000:]
    assert kill_run(killed, str(tmp_path)) >= 1 or not os.environ.get("RAY_ADDRESS")  # its actors went with it
    complete = sorted(int(p.parent.name[5:]) for p in (run / "checkpoints").glob("step_*/trainer.json"))
    resumed_from = complete[-1] if complete else 0
    if point == "checkpoint":  # the half-written marker was never renamed: the previous checkpoint is the last one
        assert resumed_from == at and list((run / f"checkpoints/step_{at + 1:06d}").glob(".trainer.json.*.tmp"))
    shutdown_ray()  # the resumed run in this process (logging_trainer.run), as a restarted process would run it
    try:
        logging_trainer.run(str(logs[1]), overrides, config_name)
    finally:
        shutdown_ray()

    first, second = _rows(logs[0]), _rows(logs[1])
    kept = [r for r in first if r[0] < resumed_from]
    assert {r[0] for r in second} == set(range(resumed_from, STEPS))  # resumed after the last complete checkpoint
    trained = [(uid, index) for _, uid, index, _ in kept + second]
    assert len(trained) == len(set(trained)) == STEPS * 2 * group  # every sample of every group, once
    # every group once; an offline pair's uid is the pair's and its draw's (pair-i@draw): none skipped, none twice
    assert len({uid for uid, _ in trained}) == len({uid.partition("@")[0] for uid, _ in trained}) == STEPS * 2
    seeds = {(uid, index): seed for _, uid, index, seed in first + second}
    assert all(seeds[(uid, index)] == seed for _, uid, index, seed in first + second)  # regenerated alike
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))  # one row per step, the killed ones replaced
    # The optimizer resumed from the checkpoint's state: one optimizer step per training step over both runs (a fresh
    # optimizer would count only the resumed run's); the old policy, where the loss keeps one, was saved beside it.
    state = torch.load(run / f"checkpoints/step_{STEPS:06d}/actor.pt", weights_only=True)
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {float(STEPS)}
    assert ("old_weights" in state) == any("old" in o and "policy_state_adapters" in o for o in base)
