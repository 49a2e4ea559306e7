"""Shared test fixtures that are plain code: the small image-trainer config, and one reward worker scoring text
samples concurrently through a real dispatcher (``tests/`` is on ``sys.path`` through its ``conftest.py``)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import ray

from omni_async.cluster import init_ray, shutdown_ray
from omni_async.reward.dispatcher import RewardDispatcher
from omni_async.reward.worker import RewardLoopWorker
from omni_async.sample import RewardOutcome

ROOT = Path(__file__).resolve().parents[1]
TEST_REWARDS = str(ROOT / "tests/reward/rewards_for_tests.py")

# tiny:sd3 at 32x32, 4 denoising steps, 2 prompts x 4 samples per step: a trainer step in seconds on CPU. LoRA rank 8
# (alpha 16) pinned: the config's default is verl's full fine-tune (lora_rank=0), and the tests on this base were
# written and their values recorded with this project's earlier default, rank-8 LoRA.
SMALL_LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]
SMALL_IMAGE_TRAINER = [
    "actor_rollout_ref.model.path=tiny:sd3",
    *SMALL_LORA,
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    "actor_rollout_ref.rollout.num_inference_steps=4",
    "actor_rollout_ref.rollout.height=32",
    "actor_rollout_ref.rollout.width=32",
    "actor_rollout_ref.rollout.algo.sde_window_range=[0,3]",
    "actor_rollout_ref.rollout.agent.max_batch_size=2",
    "reward.custom_reward_function.path=pkg://omni_async.reward.scorers.jpeg",
    "trainer.logger=[jsonl]",
    "trainer.resume_mode=disable",
    "data.shuffle=false",
    # pi_old = the rollout's log-probs, as when these tests were written: the lock-step default is now verl-omni's
    # recompute (bypass_mode=false), a forward per step that the tests on this base are not about; the recompute's
    # own tests give bypass_mode=false (test_rollout_correction, test_pi_old_sync_window, test_window_losses, ...)
    "algorithm.rollout_correction.bypass_mode=true",
]


def drawn_latents(samples, weights=None):
    """What SMALL_IMAGE_TRAINER's policy (tiny SD3 at 32x32, 4 steps, LoRA rank 8 on its target modules) with LoRA
    ``weights`` (None: the untrained adapter, B = 0, i.e. the base model) draws for these samples' prompts and seeds,
    in process: which weights a final-latent rollout sampled with."""
    import torch

    from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig

    policy = DiffusionPolicy(
        "tiny:sd3",
        SamplingConfig(height=32, width=32, num_inference_steps=4, clean_latents=True),
        lora_rank=8,
        lora_alpha=16,
        target_modules=["to_q", "to_k", "to_v", "to_out.0"],
    )
    if weights is not None:
        policy.load_weights_state_dict(weights)
    out = policy.generate([s.row.prompt for s in samples], [s.seed for s in samples])
    return torch.stack([r.latents_clean for r in out])


def score_on_one_worker(
    fn_name: str, reward_kwargs: dict, samples: int, max_inflight: int
) -> tuple[list[RewardOutcome], float]:
    """``samples`` text samples scored by ``rewards_for_tests.<fn_name>`` on one real reward-loop worker through a
    real dispatcher, all at once; returns the outcomes and the wall time of the whole batch."""
    shutdown_ray()
    init_ray(num_gpus=0, num_cpus=4)
    try:
        cfg = {
            "timeout_s": 30,
            "max_inflight_per_worker": max_inflight,
            "reward_functions": {},
            "custom_reward_function": {"path": TEST_REWARDS, "name": fn_name, "reward_kwargs": reward_kwargs},
        }
        worker = ray.remote(RewardLoopWorker).options(max_concurrency=max_inflight + 8).remote(cfg, 0)
        ray.get(worker.info.remote())
        records = [
            {
                "prompt": "q",
                "data_source": "x",
                "ground_truth": "1",
                "extra_info": {},
                "uid": str(i),
                "solution_str": f"answer {i}",
            }
            for i in range(samples)
        ]

        async def run():
            dispatcher = RewardDispatcher(
                [worker], queue_size=max(64, samples), max_inflight_per_worker=max_inflight, timeout_s=30
            )
            t0 = time.perf_counter()
            outcomes = await asyncio.gather(*(dispatcher.score(r) for r in records))
            return outcomes, time.perf_counter() - t0

        return asyncio.run(run())
    finally:
        shutdown_ray()


def record_client_sleeps(monkeypatch, wait: bool = True) -> list[float]:
    """The delays the HTTP reward client (``omni_async.reward.http_client``) sleeps between attempts, in order: what a
    test asserts instead of timing the call (a Retry-After honoured is a sleep of that length, on any machine).
    ``wait=False`` records without waiting (the retry comes at once)."""
    from omni_async.reward import http_client

    slept: list[float] = []

    class RecordingAsyncio:
        def __getattr__(self, name: str):
            return getattr(asyncio, name)

        async def sleep(self, delay: float, *args, **kwargs):
            slept.append(float(delay))
            await asyncio.sleep(delay if wait else 0, *args, **kwargs)

    monkeypatch.setattr(http_client, "asyncio", RecordingAsyncio())
    return slept


def write_prompts(path: Path, n: int, data_source: str = "x") -> Path:
    """``n`` prompt rows ``p0..`` in the trainer's jsonl format (empty ground truth)."""
    path.write_text(
        "".join(
            json.dumps({"prompt": f"p{i}", "data_source": data_source, "reward_model": {"ground_truth": ""}}) + "\n"
            for i in range(n)
        )
    )
    return path


def write_ocr_rows(path: Path, n: int) -> None:
    """``n`` OCR prompt rows (``a sign that says "WORDi"``, ground truth ``WORDi``) in verl-omni's row layout."""
    rows = [
        {
            "prompt": f'a sign that says "WORD{i}"',
            "data_source": "ocr",
            "reward_model": {"ground_truth": f"WORD{i}", "style": "rule"},
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


class Trainers:
    """Builds trainers for a test, one Ray session each (a trainer owns its placement groups), weights synced to
    version 0; building one closes the ones before it (their results stay readable), and ``close`` ends the last."""

    def __init__(
        self,
        train_file: Path,
        run_root: Path,
        base: list[str] = SMALL_IMAGE_TRAINER,
        config_name: str = "flowgrpo_trainer",
    ):
        self.train_file, self.run_root, self.base, self.config_name = train_file, run_root, list(base), config_name
        self.made: list = []

    def __call__(self, *overrides: str):
        from omni_async.trainer.config import compose
        from omni_async.trainer.loop import RLTrainer

        # The previous trainer's threads stop before its Ray session ends: a Ray call from its agent loop after
        # ray.shutdown would start a new connection (Ray's auto-init) racing this trainer's init_ray.
        for t in self.made:
            t.close()
        shutdown_ray()
        cfg = compose(
            [
                f"data.train_files={self.train_file}",
                f"trainer.run_dir={self.run_root}/run{len(self.made)}",
                *self.base,
                *overrides,
            ],
            config_name=self.config_name,
        )
        self.made.append(RLTrainer(cfg))
        self.made[-1].sync_weights(0)
        return self.made[-1]

    def close(self) -> None:
        for t in self.made:
            t.close()  # the rollouter's tasks end before the loop does
        shutdown_ray()


def two_node_cluster(num_cpus: int = 8):
    """A Ray cluster of two raylets on this machine, one (logical) device each."""
    from ray.cluster_utils import Cluster

    shutdown_ray()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": num_cpus, "num_gpus": 1})
    cluster.add_node(num_cpus=num_cpus, num_gpus=1)
    cluster.wait_for_nodes()
    return cluster


def record_trained_uids(ops) -> list[str]:
    """Spy on ``StepOps.optimizer_step``: the returned list fills with the uid of every sample trained, in order."""
    trained: list[str] = []
    real_step = ops.optimizer_step

    def recording_step(minibatch, timer):
        trained.extend(minibatch.non_tensor_batch["uid"].tolist())
        return real_step(minibatch, timer)

    ops.optimizer_step = recording_step
    return trained


def train_step_killing_rollout(trainer, step: int, replica, after_batches: int = 1) -> tuple[dict, list]:
    """``trainer.train_step(step)`` with rollout worker ``replica`` killed (as kill -9; Ray restarts it) once it has
    generated ``after_batches`` request batches, i.e. with the rest of its requests in flight. Returns the step's
    ``(metrics, samples)``."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(trainer.train_step(step)))
    thread.start()
    deadline = time.time() + 120
    while len(ray.get(replica.stats.remote())["batch_sizes"]) < after_batches and time.time() < deadline:
        time.sleep(0.05)
    ray.kill(replica, no_restart=False)
    thread.join(timeout=300)
    # The step may end on samples made before the kill while Ray still restarts the worker (images: a turn's
    # requests go out as one call, so the first batch can hold all the step needs); a caller's next direct call would
    # meet "the actor is restarting". Wait until it answers again.
    deadline = time.time() + 120
    while True:
        try:
            ray.get(replica.stats.remote())
            break
        except ray.exceptions.ActorUnavailableError:
            if time.time() > deadline:
                raise
            time.sleep(0.1)
    return out[0]


def shipped_renderer_policy(tmp_path_factory, name: str):
    """A module fixture's body: the shipped tiny text renderer ``name`` resolved into an empty cache (the offline
    route a fresh clone takes) and loaded by ``DiffusionPolicy`` as the OCR example samples it (64², 10 steps, noise
    0.7, LoRA r4)."""
    import pytest

    from omni_async.models import tiny
    from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig

    mp = pytest.MonkeyPatch()
    mp.setenv("OMNI_ASYNC_CACHE", str(tmp_path_factory.mktemp("cache")))
    try:
        path = tiny.resolve_model_path(name)
        yield DiffusionPolicy(
            path,
            SamplingConfig(height=64, width=64, num_inference_steps=10, noise_level=0.7),
            lora_rank=4,
            lora_alpha=8,
        )
    finally:
        mp.undo()


def switch_mode(trainer, *, streaming: bool | None = None, **async_reward: bool) -> None:
    """Go on training ``trainer`` in another mode: ``async_reward.<key>=<value>`` (and ``reward.streaming``) applied to
    a copy of its config, the producer restarted at its position (``RLTrainer.set_mode``). ``streaming=False`` also
    takes the agent loop's reward dispatcher away, so samples come back unscored and the update scores them."""
    import copy

    from omni_async.trainer.mode import mode_of

    cfg = copy.deepcopy(trainer.cfg)
    for key, value in async_reward.items():
        cfg.async_reward[key] = value
    if async_reward.get("update_pipeline"):  # the pipeline's advantages use each group's own std (config.validate)
        trainer.ops.cfg.algorithm.global_std = False
    if streaming is not None:
        cfg.reward.streaming = str(streaming).lower()
        if not streaming:
            trainer.agent.dispatcher = None
    trainer.set_mode(mode_of(cfg))
    # The actor workers follow the new mode as a trainer built for it would: generation reads a snapshot of the
    # adapter exactly where the rollout is the actor and updates now overlap it.
    import ray

    want = trainer.layout.rollout_is_actor and trainer.mode.overlaps_update
    stats = ray.get([w.stats.remote() for w in trainer.layout.actor_wg.workers])
    assert all(s["snapshot_rollout"] == want for s in stats), (want, stats)


LOCK_STEP_MODES = (  # (name, switch_mode arguments) in the order a streaming trainer goes through them
    ("stream+pipeline", {"update_pipeline": True}),
    ("stream+one_step_off", {"update_pipeline": False, "one_step_off_policy": True}),
    ("all", {"update_pipeline": True}),
)


def through_lock_step_modes(trainer, step: int, loss_metric: str) -> int:
    """Go on training a streaming ``trainer`` (built with ``reward.streaming=true``: the reward queue exists) one step
    in each other lock-step mode (the pipeline, one-step-off and both), asserting each step trained (a finite
    ``loss_metric``, a gradient, no failed reward) and every group was trained whole and once across the switches;
    returns the next step. The loss x mode matrix docs/losses.md states is this plus each loss's own tests."""
    import math
    from collections import Counter

    assert trainer.agent.dispatcher is not None, "build the trainer with reward.streaming=true"
    trained = record_trained_uids(trainer.ops)
    for name, switch in LOCK_STEP_MODES:
        switch_mode(trainer, **switch)
        metrics, _ = trainer.train_step(step)
        assert math.isfinite(metrics[loss_metric]) and metrics["actor/grad_norm"] > 0, (name, metrics)
        assert metrics["reward/failed"] == 0, name
        step += 1
    group = int(trainer.cfg.actor_rollout_ref.rollout.n)
    assert set(Counter(trained).values()) == {group}  # every group whole and once across the switches
    return step
