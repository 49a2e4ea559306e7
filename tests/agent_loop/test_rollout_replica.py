"""Rollout replicas as real Ray actors: request batching, weight versions, reproducible sampling."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import ray

from omni_async.agent_loop.rollout_replica import RolloutReplica, sample_seed
from omni_async.cluster import init_ray, shutdown_ray
from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig

MODEL = {"path": "tiny:sd3", "lora_rank": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_v"]}
SAMPLING = {"height": 32, "width": 32, "num_inference_steps": 3}


def test_replica_batches_requests_and_reports_versions():
    shutdown_ray()
    init_ray(num_gpus=0, num_cpus=4)
    try:
        # max_wait 1 s: the 6 requests reach the replica within it even on a loaded machine (50 ms gave [1, 1, 4]).
        rep = ray.remote(RolloutReplica).remote("image", MODEL, SAMPLING, 4, 1000.0)
        seeds = [sample_seed(42, 0, i) for i in range(6)]
        windows = [(i % 2, i % 2 + 2) for i in range(6)]  # per-sample windows of one length share device batches
        outs = ray.get(
            [rep.generate.remote(f"p{i}", s, w) for i, (s, w) in enumerate(zip(seeds, windows, strict=True))]
        )
        assert sorted(ray.get(rep.stats.remote())["batch_sizes"]) == [2, 4]  # 6 concurrent requests, max batch 4
        assert {o.version for o in outs} == {0}
        assert [o.result.window_start for o in outs] == [w[0] for w in windows]
        # Same (prompt, seed, window, weights) -> same sample, however it was batched and beside whichever windows.
        # (A batch of 2 and a batch of 1 differ by float rounding in the transformer, ~4e-7 here: a pixel may round
        # to the neighbouring uint8 value.)
        again = ray.get(rep.generate.remote("p5", seeds[5], windows[5]))
        assert np.abs(again.result.pixels.astype(int) - outs[5].result.pixels).max() <= 1
        assert np.allclose(again.result.window_latents, outs[5].result.window_latents, atol=1e-5)
        assert np.allclose(again.result.log_probs, outs[5].result.log_probs, atol=1e-5)

        policy = DiffusionPolicy(
            "tiny:sd3", SamplingConfig(**SAMPLING), lora_rank=4, lora_alpha=8, target_modules=["to_q", "to_v"]
        )
        state = {k: v + 0.1 for k, v in policy.weights_state_dict().items()}
        assert ray.get(rep.set_weights.remote(state, 3)) == 3
        updated = ray.get(rep.generate.remote("p5", seeds[5], windows[5]))
        assert updated.version == 3 and not np.array_equal(updated.result.pixels, outs[5].result.pixels)
    finally:
        shutdown_ray()


def test_sample_seed_is_a_pure_function_of_its_inputs():
    assert sample_seed(1, 2, 3) == sample_seed(1, 2, 3)
    assert len({sample_seed(1, s, i, k) for s in range(3) for i in range(3) for k in range(3)}) == 27


def test_weight_sync_runs_on_the_device_thread_between_batches(monkeypatch):
    """A sync that arrives while a batch is on the device waits for it (the batch never sees half-loaded weights),
    and the next batch, queued while the load runs, runs on the new weights and reports their version."""
    monkeypatch.setattr("omni_async.cluster.configure_worker", lambda: "cpu")  # in-process: no Ray worker to ask
    replica = RolloutReplica("image", MODEL, SAMPLING, 4, 1.0)
    new_weights = {k: v + 0.1 for k, v in replica.policy.weights_state_dict().items()}
    events, batch_started = [], threading.Event()
    generate, load = replica.batcher.generate, replica.policy.load_weights_state_dict

    def slow_generate(*args, **kwargs):
        events.append("batch")
        batch_started.set()
        time.sleep(0.3)  # a sync sent now must not land inside this batch
        out = generate(*args, **kwargs)
        events.append("batch done")
        return out

    def slow_load(state):
        events.append("load")
        time.sleep(0.3)  # the next batch is queued meanwhile: it must not run, nor take its version, before this
        load(state)
        events.append("load done")

    replica.batcher.generate, replica.policy.load_weights_state_dict = slow_generate, slow_load

    async def scenario():
        first = asyncio.create_task(replica.generate("p", 5, (0, 2)))
        await asyncio.to_thread(batch_started.wait)
        sync = asyncio.create_task(replica.set_weights(new_weights, 3))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(replica.generate("p", 5, (0, 2)))
        return await first, await sync, await second

    first, version, second = asyncio.run(scenario())
    assert events == ["batch", "batch done", "load", "load done", "batch", "batch done"]
    assert (first.version, version, second.version) == (0, 3, 3)
    assert not np.array_equal(first.result.pixels, second.result.pixels)  # same seed, new weights


def test_a_staged_sync_does_not_wait_for_the_device_and_older_requests_finish_on_their_weights(monkeypatch):
    """``set_weights(..., activate=False)`` (one-step-off's sync while the look-ahead generates, fully async's) returns
    while a batch is on the device; a request for the old version queued meanwhile still runs on the old weights, the
    new set is written in between two batches, before the first request for it, and a request for a version not yet
    here waits for it."""
    monkeypatch.setattr("omni_async.cluster.configure_worker", lambda: "cpu")
    replica = RolloutReplica("image", MODEL, SAMPLING, 4, 1.0)
    base = replica.policy.weights_state_dict()
    events, batch_started = [], threading.Event()
    generate, load = replica.batcher.generate, replica.policy.load_weights_state_dict

    def slow_generate(*args, **kwargs):
        events.append("batch")
        batch_started.set()
        time.sleep(0.3)
        return generate(*args, **kwargs)

    def logged_load(state):
        events.append("load")
        load(state)

    replica.batcher.generate, replica.policy.load_weights_state_dict = slow_generate, logged_load

    async def scenario():
        first = asyncio.create_task(replica.generate("p", 5, (0, 2), version=0))
        await asyncio.to_thread(batch_started.wait)
        staged = await replica.set_weights({k: v + 0.1 for k, v in base.items()}, 1, activate=False)
        events.append("staged")
        assert not first.done()  # the sync did not wait for the batch on the device
        old = asyncio.create_task(replica.generate("p", 5, (0, 2), version=0))
        new = asyncio.create_task(replica.generate("p", 5, (0, 2), version=1))
        later = asyncio.create_task(replica.generate("p", 5, (0, 2), version=2))
        results = await first, await old, await new
        await asyncio.sleep(0.2)
        assert not later.done()  # version 2 is not here yet: the request waits, nothing runs on other weights
        events.append("stage 2")
        await replica.set_weights({k: v + 0.2 for k, v in base.items()}, 2, activate=False)
        return staged, *results, await later

    staged, first, old, new, later = asyncio.run(scenario())
    assert staged == 1  # and the request for the old version queued after it ran before the load
    assert events == ["batch", "staged", "batch", "load", "batch", "stage 2", "load", "batch"]
    assert [r.version for r in (first, old, new, later)] == [0, 0, 1, 2]
    assert np.array_equal(old.result.pixels, first.result.pixels)  # same seed, same (old) weights
    assert not np.array_equal(new.result.pixels, first.result.pixels)
