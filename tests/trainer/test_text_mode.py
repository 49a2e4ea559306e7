"""Text mode (GRPO on tiny:qwen2) through the same loop, agent loop and reward workers (real Ray, in-process)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import score_on_one_worker

from omni_async.cluster import shutdown_ray
from omni_async.trainer.config import compose
from omni_async.trainer.loop import FlowGRPOTrainer
from omni_async.trainer.mode import fully_async_overrides

ROOT = Path(__file__).resolve().parents[2]
TEST_REWARDS = str(ROOT / "tests/reward/rewards_for_tests.py")
DIGITS = ["reward.custom_reward_function.name=compute_score_digits"]
SMALL = [
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.rollout.response_length=16",
    "actor_rollout_ref.rollout.agent.max_batch_size=8",
    "actor_rollout_ref.actor.optim.lr=2e-3",
    "trainer.logger=[jsonl]",
    "trainer.resume_mode=disable",
    "trainer.log_timeline_freq=-1",
    "data.shuffle=false",
    # pi_old = the rollout's log-probs: no test here is about the lock-step recompute (verl-omni's default), a
    # forward per step. The digits curve below is the same either way to 0.001 (0.046 -> 0.496 over 20 updates,
    # 2026-11-27), the steps 24% shorter.
    "algorithm.rollout_correction.bypass_mode=true",
]


def write_arith(out: Path) -> Path:
    """The arithmetic prompts of the text tests (64 train, 4 val) under ``out``, by the example's data script."""
    import subprocess
    import sys

    script = ROOT / "examples/data/prepare_arithmetic.py"
    args = [sys.executable, str(script), "--out-dir", str(out), "--num-train", "64", "--num-val", "4"]
    subprocess.run(args, check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def arith(tmp_path_factory):
    return write_arith(tmp_path_factory.mktemp("arith"))


def make(arith, tmp_path, *overrides) -> FlowGRPOTrainer:
    shutdown_ray()
    cfg = compose(
        [f"data.train_files={arith}/train.jsonl", f"trainer.run_dir={tmp_path}/run", *SMALL, *overrides],
        config_name="grpo_text_trainer",
    )
    trainer = FlowGRPOTrainer(cfg)
    trainer.sync_weights(0)
    return trainer


def close(trainer) -> None:
    trainer.close()
    shutdown_ray()


# Fully async at staleness 1 on rollout replicas of their own (split layout): an update = the lock-step step's 4 prompts.
# verl's default partial_rollout=true: responses in flight at a sync are continued under the new weights (measured:
# 50 and 79 responses continued across a sync over the 20 updates in two runs; rise 0.23 and 0.25).
def fully_async_text(staleness: float) -> list[str]:
    return [
        "actor_rollout_ref.hybrid_engine=false",
        *fully_async_overrides(staleness),
        "async_training.require_batches=2",
    ]


FULLY_ASYNC_1 = fully_async_text(1)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], FULLY_ASYNC_1], ids=["on_policy", "fully_async_staleness_1"])
def test_text_grpo_learns_a_format_reward(arith, tmp_path, mode):
    """Digits share of the response (a random tiny LM emits a digit ~4% of the time): measured 0.05 -> 0.49 over
    20 steps with these settings (0.99 after 40); per-step noise of the mean is ~0.01, the margin is 0.15. Fully
    async at staleness 1 (every update trains on samples of the weights one update old at most) must clear the same
    margin."""
    curve = learn_digits(arith, tmp_path, *mode)
    assert np.mean(curve[-3:]) > np.mean(curve[:3]) + 0.15, [round(c, 3) for c in curve]


def learn_digits(arith: Path, tmp_path: Path, *overrides: str, with_rows: bool = False):
    """20 updates of the digits reward; the per-update reward means (and the metric rows with ``with_rows``)."""
    trainer = make(arith, tmp_path, *DIGITS, "trainer.total_training_steps=20", "trainer.log_image_freq=-1", *overrides)
    try:
        trainer.fit()
    finally:
        shutdown_ray()
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    curve = [r["critic/rewards/mean"] for r in rows]
    return (curve, rows) if with_rows else curve


@pytest.mark.slow
def test_text_stream_and_sync_score_the_same_with_class_post_process_and_tuple_rewards(arith, tmp_path):
    """Text in both reward modes and both layouts (stream on the hybrid layout, sync on the split one), with a
    stateful reward class that repairs failures per group and a function returning a tuple: the same samples get
    the same scores either way, and a streamed score lands on the response's last token."""
    fns = [
        f"+reward.reward_functions.repaired.path={TEST_REWARDS}",
        "+reward.reward_functions.repaired.name=FailingThenRepaired",
        f"+reward.reward_functions.tuple.path={TEST_REWARDS}",
        "+reward.reward_functions.tuple.name=tuple_reward",
        "+reward.reward_functions.tuple.weight=0.5",
    ]
    scores = {}
    for streaming, hybrid in (("true", "true"), ("false", "false")):
        trainer = make(
            arith, tmp_path, *fns, f"reward.streaming={streaming}", f"actor_rollout_ref.hybrid_engine={hybrid}"
        )
        try:
            metrics, samples = trainer.train_step(0)
            assert trainer.reward.colocated_used == (streaming == "false")
            if streaming == "true":
                assert metrics["timing_s/reward"] == 0.0
                batch = trainer.ops.build_batch(samples)
                rm, mask = batch.batch["rm_scores"], batch.batch["response_mask"]
                for i, s in enumerate(samples):
                    last = len(s.result.response_ids) - 1
                    assert mask[i].sum() == last + 1 and rm[i, last] == pytest.approx(s.outcome.score)
                    assert rm[i].sum() == pytest.approx(s.outcome.score)  # and nowhere else
        finally:
            close(trainer)
        for s in samples:
            o, n = s.outcome, len(s.result.response)
            assert o.ok and o.extra["judge_text"] == s.result.response[:5]
            assert o.parts["tuple"] == n % 3
            if n % 2:  # scored directly
                assert o.parts["repaired"] == pytest.approx(1 + n / 100)
            else:  # failed, then repaired with its group's mean
                group = [m.outcome.parts["repaired"] for m in samples if m.uid == s.uid and len(m.result.response) % 2]
                assert o.extra.get("reward/post_process_repaired") == 1.0
                assert o.parts["repaired"] == pytest.approx(np.mean(group) if group else 0.0)
            assert o.score == pytest.approx(o.parts["repaired"] + 0.5 * o.parts["tuple"])
        assert metrics["reward/failed"] == 0 and "reward/tuple" in metrics and "reward/combined" in metrics
        scores[streaming] = [
            (s.index, s.result.response, s.outcome.score) for s in sorted(samples, key=lambda s: s.index)
        ]
    assert [x[:2] for x in scores["true"]] == [x[:2] for x in scores["false"]]  # the same responses
    assert [x[2] for x in scores["true"]] == pytest.approx([x[2] for x in scores["false"]])


def test_500_async_scores_are_in_flight_at_once_on_one_worker():
    """500 async calls (a remote judge's) on one worker are all in flight together, so a batch of them takes about
    one latency: each call returns only once all 500 are in (a rendezvous), which a worker running fewer at a time
    never reaches (its calls fail at the rendezvous' timeout)."""
    outcomes, _ = score_on_one_worker("async_rendezvous", {"parties": 500}, samples=500, max_inflight=1000)
    assert all(o.ok and o.score == 1.0 for o in outcomes), {o.error for o in outcomes if not o.ok}


@pytest.mark.slow
def test_text_example_script_short_variant(tmp_path):
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "DATA_DIR": str(tmp_path / "data"),
        "RUN_DIR": str(tmp_path / "run"),
        "STEPS": "1",
        "BATCH": "2",
        "GROUP": "2",
        "RESPONSE_LENGTH": "8",
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "examples/run_text_grpo_async_reward.sh"), "trainer.logger=[jsonl]"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "run directory:" in proc.stdout
    row = json.loads((tmp_path / "run/metrics.jsonl").read_text().splitlines()[0])
    assert (
        row["timing_s/reward"] == 0.0
        and row["reward_queue/total_consumed"] == 4
        and any(k.startswith("val-core/") for k in row)
    )
    assert (tmp_path / "run/samples/step_0001.jsonl").exists()
