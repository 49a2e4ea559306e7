"""Step and validation metrics under verl's / verl-omni's names and meanings (``trainer.metrics``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omni_async.agent_loop.batcher import Generation
from omni_async.agent_loop.manager import AgentLoopManager
from omni_async.sample import ImageResult, PromptRow, RewardOutcome, Sample, TextResult
from omni_async.trainer.metrics import (
    advantage_metrics,
    discard_metrics,
    off_policy_metrics,
    response_length_metrics,
    throughput_metrics,
    validation_metrics,
    validation_reward_mean,
)


def _sample(i: int, uid: str, source: str, score: float | None, response_len: int = 0) -> Sample:
    s = Sample(index=i, uid=uid, row=PromptRow("p", source, "gt"), seed=i)
    s.outcome = RewardOutcome("ok", score) if score is not None else RewardOutcome("failed", error="boom")
    s.result = TextResult(
        prompt_ids=[1, 2, 3], response_ids=list(range(response_len)), response="r", log_probs=torch.zeros(response_len)
    )
    return s


def test_validation_keys_are_verls_core_and_aux_sections():
    samples = [
        _sample(0, "a", "ocr", 0.2),
        _sample(1, "a", "ocr", 0.6),
        _sample(2, "b", "ocr", 1.0),
        _sample(3, "b", "ocr", None),
        _sample(4, "c", "gsm8k", 0.0),
        _sample(5, "c", "gsm8k", 1.0),
    ]
    m = validation_metrics(samples)
    # verl: per prompt, the mean of its n ok samples, averaged over the prompts with that n; the core key is the
    # largest n (prompt b lost a sample to a failed reward call: it is reported under mean@1, an aux key).
    assert m["val-core/ocr/reward/mean@2"] == pytest.approx(0.4) and m["val-aux/ocr/reward/mean@1"] == 1.0
    assert m["val-core/gsm8k/reward/mean@2"] == pytest.approx(0.5)
    assert "val-core/ocr/reward/best@2/mean" in m and "val-aux/ocr/reward/std@2" in m
    assert "val-aux/ocr/reward/worst@2/mean" in m and m["val-aux/reward/failed"] == 1.0
    assert not any(k.startswith("val/") for k in m)
    assert validation_reward_mean(m) == pytest.approx((0.4 + 0.5) / 2)
    assert validation_reward_mean({"step": 3, "critic/rewards/mean": 0.1}) is None


def test_advantages_weigh_text_tokens_and_throughput_is_per_device():
    a, b = _sample(0, "a", "x", 1.0, response_len=3), _sample(1, "a", "x", 0.0, response_len=1)
    masked = _sample(2, "b", "x", 0.5, response_len=9)
    a.advantage, b.advantage, masked.advantage = 1.0, -1.0, None
    m = advantage_metrics([a, b, masked])
    # verl averages over valid response tokens: (3 x 1.0 + 1 x -1.0) / 4; a masked sample is not in the loss.
    assert m == {"critic/advantages/mean": 0.5, "critic/advantages/max": 1.0, "critic/advantages/min": -1.0}
    t = throughput_metrics([a, b, masked], step_s=2.0, n_devices=4)
    tokens = 3 * 3 + 3 + 1 + 9  # prompt + response tokens, as verl's global_token_num
    assert t["perf/total_num_tokens"] == tokens and t["perf/throughput"] == pytest.approx(tokens / (2.0 * 4))
    assert t["perf/samples_per_s"] == 1.5 and t["perf/time_per_step"] == 2.0
    r = response_length_metrics([a, b, masked], max_length=9)
    assert r == {
        "response_length/mean": pytest.approx(13 / 3),
        "response_length/max": 9.0,
        "response_length/min": 1.0,
        "response_length/clip_ratio": pytest.approx(1 / 3),
    }


def test_off_policy_metrics_are_verl_v1s_staleness_from_the_newest_and_worst_from_the_oldest_version():
    """Trained at step 5: a response continued across two syncs (tokens of versions 3, 4), one of version 4 alone,
    one of version 5 (a partial rollout's first part is its oldest, verl's param_version_start; its last part the
    newest, param_version_end)."""
    samples = [_sample(i, "a", "x", 1.0, response_len=3) for i in range(3)]
    for s, versions in zip(samples, ([3, 3, 4], [4, 4, 4], [5, 5, 5]), strict=True):
        s.result.versions = torch.tensor(versions)
        s.version = versions[0]
    m = off_policy_metrics(samples, step=5, partial=True)
    assert m["training/off_policy/trajectory_staleness/max"] == 1.0  # 5 - newest
    assert m["training/off_policy/trajectory_staleness/mean"] == pytest.approx((1 + 1 + 0) / 3)
    assert m["training/off_policy/trajectory_staleness_worst/max"] == 2.0  # 5 - oldest
    assert m["training/off_policy/trajectory_spans/max"] == 2.0 and m["fully_async/partial/max_partial_span"] == 1.0
    assert m["fully_async/partial/total_partial_num"] == 1.0
    assert m["fully_async/partial/partial_ratio"] == pytest.approx(1 / 3)
    assert not any(k.startswith("fully_async/") for k in off_policy_metrics(samples, step=5, partial=False))


class _Worker:
    """A rollout worker stand-in behind the ``worker.generate.remote(...)`` call shape: answers each request with
    ``answers`` in turn (a withdrawn answer makes the agent loop ask again), then with an image."""

    def __init__(self, *answers: Generation):
        self.answers = list(answers)
        self.generate = SimpleNamespace(remote=self._generate)

    async def _generate(self, prompt, seed, window, **kwargs):
        if self.answers:
            return self.answers.pop(0)
        image = ImageResult(np.zeros((8, 8, 3), np.uint8), torch.zeros(3, 4), torch.zeros(2), {}, window_start=0)
        return Generation(image, 0, 0.0, 1.0)


def test_samples_discarded_at_syncs_are_counted_and_are_none_here_by_construction():
    """``rollout/discarded_at_sync`` counts generations thrown away in flight and started again (verl-omni's abort of
    the diffusion samples in flight when it switches to training); ``training/discarded_samples`` adds the samples of
    groups dropped past the lag bound. A request withdrawn before it started throws nothing away; one withdrawn
    mid-generation (text on a trainer rank going back to training without partial rollout) does."""
    assert discard_metrics({"rollout/resumed": 3.0}) == {"training/discarded_samples": 0.0}
    both = {"rollout/discarded_at_sync": 1.0, "training/off_policy/dropped_samples": 4.0}
    assert discard_metrics(both) == {"training/discarded_samples": 5.0}
    unstarted, started = Generation(None, -1, 0.0, 0.0), Generation(None, -1, 0.0, 0.0, discarded=True)
    agent = AgentLoopManager([_Worker(unstarted, started, unstarted)])
    try:
        samples = [Sample(index=i, uid="0-0", row=PromptRow("p", "x", None), seed=i) for i in range(2)]
        agent.call(agent.run_group(samples))
        assert all(s.result is not None for s in samples)
        m = agent.step_metrics()
        assert m["separate_async/switch/requeued"] == 3.0 and m["rollout/discarded_at_sync"] == 1.0
        agent.call(agent.run_group([Sample(index=2, uid="1-0", row=PromptRow("p", "x", None), seed=2)]))
        assert agent.step_metrics()["rollout/discarded_at_sync"] == 0.0  # per step
    finally:
        agent.shutdown()
