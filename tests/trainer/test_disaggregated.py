"""The disaggregated layout (``actor_rollout_ref.rollout.nnodes`` > 0): inference-only rollout workers on their own
devices, trainer ranks on the rest, weights sent across the pools (``checkpoint_engine``: a gloo group here).

Real Ray workers on logical devices; one trainer per test, small models, few steps.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import ray
import torch
from helpers import SMALL_LORA, Trainers, record_trained_uids, switch_mode, train_step_killing_rollout, write_prompts

from omni_async.agent_loop.weight_sync import meta_bytes, plan_buckets
from omni_async.trainer.config import ConfigError, compose, layout, validate
from omni_async.trainer.mode import mode_of

POOL = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1"]
QUIET = ["trainer.log_image_freq=-1", "trainer.log_timeline_freq=-1"]
NCCL = ["actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"]


# The image config's keys here were written with LoRA (rank 8, alpha 16: this project's earlier default). verl's default
# rank 0, a full fine-tune, is refused in the hybrid layout's overlap modes and ships to a rollout pool only with
# checkpoint_engine nccl; a test of that passes lora_rank=0 itself.
def valid(*overrides: str, config_name: str = "flowgrpo_trainer"):
    lora = SMALL_LORA if config_name == "flowgrpo_trainer" else []
    return validate(compose(["data.train_files=x.jsonl", *lora, *overrides], config_name=config_name))


# ---- keys (no Ray) ---------------------------------------------------------------------------------------------
def test_both_spellings_compose_to_the_same_layout():
    canonical = valid(*POOL, "trainer.n_gpus_per_node=2")
    verl_recipe = valid("rollout.nnodes=1", "rollout.n_gpus_per_node=1", "trainer.n_gpus_per_node=2")
    for cfg in (canonical, verl_recipe):
        assert layout(cfg) == "disaggregated"
        assert (cfg.actor_rollout_ref.rollout.nnodes, cfg.actor_rollout_ref.rollout.n_gpus_per_node) == (1, 1)
    assert layout(valid()) == "hybrid" and layout(valid("actor_rollout_ref.hybrid_engine=false")) == "split"
    # verl's V1 spelling of async training on a rollout pool (fully async here), with its sync-period alias (verl's
    # meaning: local updates; in fully async a step is one update)
    v1 = valid(
        *POOL,
        "trainer.use_v1=true",
        "trainer.v1.trainer_mode=separate_async",
        "trainer.v1.separate_async.parameter_sync_step=4",
    )
    assert v1.async_reward.fully_async and v1.async_training.trigger_parameter_sync_step == 4
    assert mode_of(v1).sync_period == 4 and mode_of(valid(*POOL)).sync_period == 1
    # lock-step modes: 4 updates of 2 prompts = 2 steps of 4 prompts
    assert mode_of(valid(*POOL, "async_training.trigger_parameter_sync_step=4")).sync_period == 2


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        (["actor_rollout_ref.rollout.nnodes=1", "rollout.nnodes=2"], "actor_rollout_ref.rollout.nnodes", "only one"),
        (["actor_rollout_ref.rollout.n_gpus=4"], "actor_rollout_ref.rollout.n_gpus", "n_gpus_per_node=4"),
        (
            ["async_training.trigger_parameter_sync_step=1", "trainer.v1.separate_async.parameter_sync_step=2", *POOL],
            "async_training.trigger_parameter_sync_step",
            "only one",
        ),
        (["trainer.v1.trainer_mode=separate_async"], "trainer.v1.trainer_mode", "actor_rollout_ref.rollout.nnodes=1"),
        ([*POOL, "trainer.v1.trainer_mode=colocate_async"], "trainer.v1.trainer_mode", "separate_async"),
        (["trainer.use_v1=false", "trainer.v1.trainer_mode=sync"], "trainer.v1.trainer_mode", "trainer.use_v1=true"),
        (["trainer.v1.trainer_mode=sync", "async_reward.one_step_off_policy=true"], "trainer.v1.trainer_mode", "drop"),
        ([*POOL, "actor_rollout_ref.model.lora_rank=0"], "checkpoint_engine.backend", "backend=nccl"),
        ([*NCCL], "checkpoint_engine.backend", "nnodes=1"),
        ([*POOL, "actor_rollout_ref.rollout.checkpoint_engine.backend=nixl"], "checkpoint_engine.backend", "nccl"),
        ([*POOL, "async_training.trigger_parameter_sync_step=3"], "trigger_parameter_sync_step", "multiple of 2"),
        (["async_training.trigger_parameter_sync_step=4"], "trigger_parameter_sync_step", "nnodes=1"),
        ([*POOL, "actor_rollout_ref.rollout.agent.num_workers=2"], "agent.num_workers", "set it to 1"),
    ],
)
def test_conflicting_and_refused_keys_name_the_fix(overrides, key, fix):
    with pytest.raises(ConfigError, match=key) as e:
        valid(*overrides)
    assert fix in str(e.value)


def test_bucket_plan_splits_large_tensors_and_bounds_each_bucket():
    meta = [("a", (10, 10), "torch.float32"), ("b", (3,), "torch.float32"), ("c", (50,), "torch.bfloat16")]
    buckets = plan_buckets(meta, bucket_bytes=64 * 4)
    assert all(b.numel * b.dtype.itemsize <= 64 * 4 for b in buckets)
    assert len({b.dtype for b in buckets[-1:]}) == 1 and buckets[-1].dtype == torch.bfloat16
    covered = {n: sum(p.hi - p.lo for b in buckets for p in b.pieces if p.name == n) for n in "abc"}
    assert covered == {"a": 100, "b": 3, "c": 50}
    assert meta_bytes(meta) == 103 * 4 + 50 * 2


def test_group_moves_every_tensor_in_small_buckets_cast_to_the_receivers_dtype():
    """Two members of a real gloo group (threads of this process): 1 KB buckets, a tensor spanning three."""
    import socket

    from omni_async.agent_loop.weight_sync import WeightGroup, tensor_meta

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address, port = "127.0.0.1", sock.getsockname()[1]
    src = {"w": torch.randn(40, 30), "b": torch.randn(7), "n": torch.arange(5)}
    dest = {"w": torch.zeros(40, 30, dtype=torch.bfloat16), "b": torch.zeros(7), "n": torch.zeros(5, dtype=torch.int64)}
    meta = tensor_meta(dest)
    groups: dict[int, WeightGroup] = {}

    def join(rank: int) -> None:
        groups[rank] = WeightGroup(address, port, rank, 2, torch.device("cpu"), timeout_s=60)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    [th.start() for th in threads]
    [th.join() for th in threads]
    got: list[int] = []
    receiver = threading.Thread(target=lambda: got.append(groups[1].receive(dest, meta, 1000)))
    receiver.start()
    sent = groups[0].send(src, meta, 1000)
    receiver.join()
    assert sent == got[0] == meta_bytes(meta) and len(plan_buckets(meta, 1000)) == 5
    assert torch.equal(dest["w"], src["w"].to(torch.bfloat16)) and torch.equal(dest["b"], src["b"])
    assert torch.equal(dest["n"], src["n"])


def test_text_long_tail_gives_each_sample_its_own_length_budget():
    from omni_async.models.text_policy import TextPolicy, TextSamplingConfig, length_budget

    budgets = [length_budget(seed, 40, 1.2) for seed in range(400)]
    assert min(budgets) == 4 and max(budgets) == 40  # x10
    assert 0.02 < sum(b == 40 for b in budgets) / 400 < 0.12  # P(cap) = 10^-1.2 = 6.3%
    assert length_budget(3, 40, None) == 40
    policy = TextPolicy(
        "tiny:qwen2", TextSamplingConfig(response_length=40, response_length_pareto_alpha=1.2), lora_rank=0
    )
    seeds = list(range(8))
    lengths = [len(r.response_ids) for r in policy.generate(["p0"] * 8, seeds)]
    assert all(n <= length_budget(s, 40, 1.2) for n, s in zip(lengths, seeds, strict=True))
    assert max(lengths) >= 3 * min(lengths)
    with pytest.raises(ConfigError, match="response_length_pareto_alpha"):
        valid("actor_rollout_ref.rollout.response_length_pareto_alpha=1.2")  # an image config


# ---- on Ray ----------------------------------------------------------------------------------------------------
def pid(handle) -> int:
    return ray.get(handle.__ray_call__.remote(lambda self: __import__("os").getpid()))


def weights(handle) -> dict[str, torch.Tensor]:
    return ray.get(handle.__ray_call__.remote(lambda self: self.policy.weights_state_dict()))


@pytest.mark.slow  # two pools trained for steps: not in the fast tier (pytest -m 'not slow')
def test_image_lora_pools_sync_over_the_group_logprobs_match_and_a_killed_worker_comes_back(trainers):
    t = trainers(
        *POOL,
        *NCCL,
        *QUIET,
        "reward.streaming=true",
        "actor_rollout_ref.actor.optim.lr=3e-2",
        "algorithm.rollout_correction.bypass_mode=false",
        "trainer.total_training_steps=7",  # the producer makes groups for 7 steps (3 on-policy, then 4 in "all")
    )
    rollout, rank0 = t.placement.rollout_workers[0], t.placement.actor_wg.workers[0]
    # Different processes on different bundles of different pools; the rollout worker holds no trainable tensor.
    assert pid(rollout) != pid(rank0)
    assert t.placement.pools.get_resource_pool("rollout") is not t.placement.pools.get_resource_pool("actor")
    assert ray.get(rollout.stats.remote())["requires_grad"] == 0
    assert not ray.get(rollout.__ray_call__.remote(lambda self: hasattr(self, "optimizer")))

    # pi_old recomputed by the trainer (bypass off) under the weights it holds = the version that generated the
    # samples (on-policy, synced over the group): it must equal the rollout's log-probs.
    checked = []
    real = t.ops.recompute_old_log_probs

    def recompute_and_compare(batch, timer, **kwargs):
        rollout_lp = batch.batch["old_log_probs"].clone()
        real(batch, timer, **kwargs)
        torch.testing.assert_close(batch.batch["old_log_probs"], rollout_lp, atol=1e-5, rtol=1e-5)
        checked.append(True)

    t.ops.recompute_old_log_probs = recompute_and_compare
    steps = [t.train_step(step) for step in range(2)]
    assert all(m["actor/grad_norm"] > 0 and m["weight_sync/bytes"] > 0 for m, _ in steps)
    assert len(checked) == 2
    r_w, a_w = weights(rollout), weights(rank0)
    assert r_w.keys() == a_w.keys()
    for k in a_w:
        torch.testing.assert_close(r_w[k], a_w[k], atol=1e-6, rtol=0)
    assert ray.get(rollout.stats.remote())["version"] == 2
    stats = ray.get(rank0.stats.remote())
    assert stats["weights_shipped"] == 0 and stats["weights_broadcast"] == 3  # the group, never the object store

    # A rollout worker killed mid-step: Ray restarts it, it gets the newest weights (version 2), its samples are
    # generated again, and every sample is trained once.
    trained = record_trained_uids(t.ops)
    t.ops.recompute_old_log_probs = real
    before = pid(rollout)
    metrics, samples = train_step_killing_rollout(t, 2, rollout, after_batches=9)
    assert pid(rollout) != before and metrics["rollout/regenerated"] >= 1
    assert {s.version for s in samples} == {2}  # the restarted worker generated with the newest weights
    assert sorted(trained) == sorted(s.uid for s in samples) and all(s.outcome.ok for s in samples)
    for k, v in weights(rollout).items():  # and it holds the trainer's newest weights again
        torch.testing.assert_close(v, weights(rank0)[k], atol=1e-6, rtol=0)

    # The mini-batch pipeline with one-step-off ("all") on the same pools: step 4 generated while step 3 trained.
    # The LoRA adapter is one bucket, so each sync is staged: sent right after the update while the look-ahead
    # generates, written in after the look-ahead's requests (every sample of step 4 is still version 3's).
    switch_mode(t, one_step_off_policy=True, update_pipeline=True)
    assert t.layout.stages
    trained.clear()
    (_, first), (m4, fourth) = t.train_step(3), t.train_step(4)
    assert sorted(trained) == sorted(s.uid for s in first + fourth)
    assert m4["training/off_policy/trajectory_staleness/max"] == 1.0 and {s.version for s in fourth} == {3}
    assert "timing_s/wait_next_rollout" not in m4  # the trainer did not wait for the look-ahead to sync

    # The rollout worker dies mid-broadcast (as its receive of step 5's sync begins), with step 6's look-ahead in
    # flight (its batches slowed to 1 s so they are): the run goes on, Ray restarts the worker, it gets the newest
    # weights (version 6) and the lost samples are generated again, by version 6; every sample is trained once.
    def slow_and_doomed(self):
        generate = self.batcher.generate
        self.batcher.generate = lambda *a, **k: (time.sleep(1.0), generate(*a, **k))[1]
        self.group._broadcast = lambda flat: os._exit(1)

    ray.get(rollout.__ray_call__.remote(slow_and_doomed))
    before = pid(rollout)
    trained.clear()
    (m5, fifth), (m6, sixth) = t.train_step(5), t.train_step(6)
    assert pid(rollout) != before and m5["rollout/regenerated"] + m6["rollout/regenerated"] >= 1
    assert {s.version for s in fifth} == {4} and 6 in {s.version for s in sixth} <= {5, 6}
    assert sorted(trained) == sorted(s.uid for s in fifth + sixth) and all(s.outcome.ok for s in fifth + sixth)
    for k, v in weights(rollout).items():  # after the last sync (version 7) the restarted worker holds rank 0's
        torch.testing.assert_close(v, weights(rank0)[k], atol=1e-6, rtol=0)


@pytest.mark.slow  # two pools trained for steps: not in the fast tier (pytest -m 'not slow')
def test_text_full_finetune_one_step_off_bf16_bucketed_over_the_group_never_through_ray_put(tmp_path, monkeypatch):
    puts: list = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda value, *a, **k: (puts.append(type(value)), real_put(value, *a, **k))[1])
    text = [
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.rollout.response_length=8",
        "actor_rollout_ref.rollout.agent.max_batch_size=4",
        "reward.custom_reward_function.name=compute_score_digits",
        "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable",
        "data.shuffle=false",
        "actor_rollout_ref.model.lora_rank=0",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=1",
    ]
    trainers = Trainers(
        write_prompts(tmp_path / "train.jsonl", 8), tmp_path, base=text, config_name="grpo_text_trainer"
    )
    try:
        t = trainers(
            *POOL,
            *NCCL,
            *QUIET,
            "reward.streaming=true",
            "async_reward.one_step_off_policy=true",
            "trainer.total_training_steps=3",
        )
        check_text_full_finetune(t, puts)
    finally:
        trainers.close()


def check_text_full_finetune(t, puts: list) -> None:
    trained: list[tuple[str, int]] = []
    results = [t.train_step(step) for step in range(3)]
    assert any(m["actor/grad_norm"] > 0 for m, _ in results)
    for w in t.placement.actor_wg.workers:
        trained += ray.get(w.trained_rows.remote())
    samples = [s for _, step_samples in results for s in step_samples]
    assert sorted(trained) == sorted((s.uid, s.index) for s in samples)  # every sample trained exactly once
    assert [m["training/off_policy/trajectory_staleness/max"] for m, _ in results] == [0.0, 1.0, 1.0]
    rollout, rank0 = t.placement.rollout_workers[0], t.placement.actor_wg.workers[0]
    r_w, a_w = weights(rollout), weights(rank0)
    big = sum(v.numel() for v in a_w.values()) * 2  # the whole model in bf16, once per step
    assert results[1][0]["weight_sync/bytes"] == pytest.approx(big)
    for k, v in a_w.items():  # bf16-exact: the rollout holds the trainer's fp32 weights rounded to bf16
        assert r_w[k].dtype == torch.bfloat16
        assert torch.equal(r_w[k], v.to(torch.bfloat16)), k
    assert ray.get(rollout.stats.remote())["requires_grad"] == 0
    assert ray.get(rank0.stats.remote())["weights_shipped"] == 0 and dict not in puts
