"""Rollout replicas as real Ray actors: request batching, weight versions, reproducible sampling."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import types

import numpy as np
import pytest
import ray
import torch

from omni_async.agent_loop.draws import sample_seed
from omni_async.agent_loop.rollout_replica import RolloutReplica
from omni_async.agent_loop.weight_sync import WeightGroup
from omni_async.cluster import init_ray, shutdown_ray
from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig

MODEL = {"path": "tiny:sd3", "lora_rank": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_v"]}
SAMPLING = {"height": 32, "width": 32, "num_inference_steps": 3}


@pytest.mark.slow  # a replica actor with a pipeline: not in the fast tier (pytest -m 'not slow')
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


# ---- partial rollout (text) ------------------------------------------------------------------------------------
TEXT_MODEL = {"path": "tiny:qwen2", "lora_rank": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
TEXT_SAMPLING = {"response_length": 24, "temperature": 1.0}


class _Handle:
    """An in-process replica behind the ``worker.generate.remote(...)`` call shape the agent loop uses."""

    def __init__(self, replica: RolloutReplica):
        self.generate = types.SimpleNamespace(remote=replica.generate)


def _pause_at_forward(policy, k: int):
    """A forward hook on the LM: its ``k``-th call (token ``k``: call 0 encodes the prompt and draws token 0) signals
    ``reached`` and holds the device thread until ``go`` is set. Armed by ``arm[0] = True``, once."""
    reached, go, calls, arm = threading.Event(), threading.Event(), [0], [False]

    def hook(_module, _inputs, _output):
        if not arm[0]:
            return
        if calls[0] == k:
            arm[0] = False
            reached.set()
            assert go.wait(30)
        calls[0] += 1

    policy.model.register_forward_hook(hook)

    def arm_it() -> None:
        calls[0], arm[0] = 0, True
        reached.clear()
        go.clear()

    return arm_it, reached, go


def test_text_partial_rollout_continues_an_interrupted_response_under_the_new_weights(monkeypatch):
    """A weight sync that arrives while a response is on the device (partial rollout) stops it after its current
    token; the agent loop asks for it again and it is continued under the new weights. With unchanged weights the
    continued response is the uninterrupted one (same tokens: the saved generator state continues the same random
    stream). With new weights each token keeps the log-prob of the version that drew it: recomputed under that
    version it matches, under the other it does not. Without partial rollout the same sync waits for the batch."""
    from omni_async.agent_loop.manager import AgentLoopManager
    from omni_async.sample import PromptRow, Sample

    monkeypatch.setattr("omni_async.cluster.configure_worker", lambda: "cpu")  # in-process: no Ray worker to ask
    replica = RolloutReplica("text", TEXT_MODEL, TEXT_SAMPLING, 4, 1.0, partial_rollout=True)
    policy = replica.policy
    policy.eos_ids = []  # a random tiny LM may stop anywhere; the test needs responses of their full length
    v0 = policy.weights_state_dict()
    v1 = {k: v + 0.05 * torch.randn_like(v, generator=torch.Generator().manual_seed(1)) for k, v in v0.items()}
    agent = AgentLoopManager([_Handle(replica)])
    k = 6  # interrupted after token k: tokens 0..k are version 0's
    arm, reached, go = _pause_at_forward(policy, k)
    seed = sample_seed(42, 0, 3)

    def sample() -> Sample:
        return Sample(index=0, uid="0-0", row=PromptRow("what is 2+3?", "x", "5"), seed=seed)

    def run(weights: dict | None, version: int, group=None) -> Sample:
        """One sample; with ``weights``, a sync to ``version`` lands while token ``k`` is being drawn: staged
        (``set_weights``), or with ``group`` (trainer rank 0's end of a weight group, 1 KB buckets) broadcast and
        written in place on the device thread (``receive_weights`` of a set larger than a bucket)."""
        s = sample()
        if weights is None:
            agent.call(agent.run_group([s]))
            return s
        arm()
        done = asyncio.run_coroutine_threadsafe(agent.run_group([s]), agent.loop)
        assert reached.wait(60)
        if group is None:
            sync = asyncio.run_coroutine_threadsafe(replica.set_weights(weights, version), agent.loop)
            waiting = replica.slots.has_staged
        else:
            meta = replica.weights_meta()
            sync = asyncio.run_coroutine_threadsafe(replica.receive_weights(version, meta, 1000), agent.loop)
            sender = threading.Thread(target=group.send, args=(weights, meta, 1000))
            sender.start()
            waiting = replica.write_waiting.is_set
        deadline = time.time() + 30
        while not waiting():  # the newer set waits (the batch on the device is held by the hook)
            assert time.time() < deadline, "the sync never told the batch on the device that newer weights wait"
            time.sleep(0.001)
        go.set()
        sync.result(60)
        done.result(60)
        assert replica.version == version
        return s

    def on_device(fn):
        """The test's own weight and setting changes go through the device thread, as the worker's do: the session
        that answered the last response may still be there taking requests, with the version it started on."""
        return replica.device_thread.submit(fn).result(60)

    def reset(partial_rollout: bool | None = None) -> None:
        policy.load_weights_state_dict(v0)
        replica.slots.set_active(0)
        if partial_rollout is not None:
            replica.partial_rollout = partial_rollout

    try:
        ref = run(None, 0)
        assert len(ref.result.response_ids) == 24 and ref.result.versions.tolist() == [0] * 24
        # a sync to the same weights: the interrupted + continued response is the uninterrupted one
        same = run(v0, 1)
        assert same.result.response_ids == ref.result.response_ids and not same.result.unfinished
        assert torch.allclose(same.result.log_probs, ref.result.log_probs, atol=1e-4)
        assert same.result.versions.tolist() == [0] * (k + 1) + [1] * (23 - k)
        assert (same.version, same.version_span) == (0, (0, 1))
        assert agent.step_metrics()["rollout/resumed"] == 1.0
        # new weights: the first k + 1 tokens as before, the rest drawn and scored by version 2
        on_device(reset)
        new = run(v1, 2)
        r = new.result
        assert r.response_ids[: k + 1] == ref.result.response_ids[: k + 1] and len(r.response_ids) == 24
        assert r.versions.tolist() == [0] * (k + 1) + [2] * (23 - k) and new.version_span == (0, 2)
        assert agent.step_metrics()["rollout/resumed"] == 1.0
        recomputed = {}
        for v, weights in ((0, v0), (2, v1)):
            on_device(lambda w=weights: policy.load_weights_state_dict(w))
            prompt, response = torch.tensor([r.prompt_ids]), torch.tensor([r.response_ids])
            recomputed[v] = policy.log_probs(prompt, torch.ones_like(prompt), response, torch.ones_like(response))[0]
        own = torch.where(r.versions == 0, recomputed[0], recomputed[2])
        other = torch.where(r.versions == 0, recomputed[2], recomputed[0])
        assert torch.allclose(r.log_probs, own, atol=1e-4), (r.log_probs - own).abs().max()
        assert (r.log_probs - other).abs()[k + 1 :].max() > 1e-2  # the versions differ where the check looks
        assert (r.log_probs - other).abs()[: k + 1].max() > 1e-2
        # without partial rollout the sync waits for the batch: one version, nothing resumed
        on_device(lambda: reset(partial_rollout=False))
        whole = run(v1, 3)
        assert whole.result.versions.tolist() == [0] * 24 and whole.result.response_ids == ref.result.response_ids
        assert agent.step_metrics()["rollout/resumed"] == 0.0
        # a weight set larger than a bucket is written in place on the device thread: the batch stops for it too, and
        # the continuation on the same weights v1 is the one of the staged sync above (same generator state)
        on_device(lambda: reset(partial_rollout=True))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        joined = asyncio.run_coroutine_threadsafe(replica.join_weight_group("127.0.0.1", port, 1, 2), agent.loop)
        rank0 = WeightGroup("127.0.0.1", port, 0, 2, torch.device("cpu"), timeout_s=60)
        joined.result(60)
        in_place = run(v1, 4, group=rank0)
        assert in_place.result.response_ids == r.response_ids and in_place.result.versions.tolist() == [0] * (k + 1) + [
            4
        ] * (23 - k)
        assert torch.allclose(in_place.result.log_probs, r.log_probs, atol=1e-4)
        assert agent.step_metrics()["rollout/resumed"] == 1.0 and replica.interrupted == 3
    finally:
        agent.shutdown()


def test_a_request_lost_with_the_ray_session_is_not_retried_through_a_new_connection():
    """A trainer left open across ``ray.shutdown`` (a second trainer built in the same process): its agent loop's
    in-flight requests fail with the session's actors. Retrying them would call Ray again and reconnect through
    Ray's auto-init, racing the next trainer's ``ray.init``; the request fails instead and Ray stays down."""
    from types import SimpleNamespace

    from ray.exceptions import RayActorError

    from omni_async.agent_loop.manager import AgentLoopManager
    from omni_async.sample import PromptRow, Sample

    calls = []

    async def gone(*args, **kwargs):
        calls.append(args)
        raise RayActorError()

    shutdown_ray()
    agent = AgentLoopManager([SimpleNamespace(generate=SimpleNamespace(remote=gone))])
    try:
        sample = Sample(index=0, uid="0-0", row=PromptRow("p", "x", None), seed=0)
        with pytest.raises(RayActorError):
            agent.call(agent.run_group([sample]))
        assert len(calls) == 1 and agent.regenerated == 0 and not ray.is_initialized()
    finally:
        agent.shutdown()
