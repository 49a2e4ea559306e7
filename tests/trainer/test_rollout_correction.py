"""verl's rollout correction keys in its decoupled mode (``bypass_mode=false``): truncated IS weights and rejection
masks between pi_old (recomputed) and the rollout's log-probs, computed with verl's own helper and applied by the
image and text losses. No Ray."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl import DataProto

from omni_async.algos.loss import flow_grpo_loss, grpo_token_loss
from omni_async.trainer.config import ConfigError, compose, validate
from omni_async.trainer.step_ops import StepOps

DECOUPLED = ["algorithm.rollout_correction.bypass_mode=false"]


def cfg(*overrides: str):
    return validate(compose(["data.train_files=x.jsonl", *overrides]))


def ops(*overrides: str) -> StepOps:
    return StepOps(cfg(*overrides), None, None, None)


def batch(old: torch.Tensor, keep: list[bool]) -> DataProto:
    return DataProto.from_dict(
        tensors={"old_log_probs": old.clone(), "loss_mask": torch.tensor(keep)},
        non_tensors={"uid": np.array(["a"] * len(keep), dtype=object)},
    )


def test_token_is_weights_are_truncated_ratios_per_window_step_and_rejection_masks_steps():
    o = ops(
        *DECOUPLED,
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=0.5_1.5",
    )
    rollout = torch.zeros(3, 2)
    old = torch.log(torch.tensor([[1.0, 3.0], [0.25, 1.2], [1.0, 1.0]]))  # pi_old / pi_rollout per SDE step
    b = batch(old, [True, True, False])
    o.rollout_correction(b, rollout)
    w = b.batch["rollout_is_weights"]
    torch.testing.assert_close(w[:2], torch.tensor([[1.0, 2.0], [0.25, 1.2]]))  # min(ratio, 2.0): verl's default
    assert torch.equal(b.batch["rollout_rs_mask"][:2], torch.tensor([[1.0, 0.0], [0.0, 1.0]]))  # outside [0.5, 1.5]
    metrics = o.take_corr_metrics()
    assert {"rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction"} <= set(metrics)
    assert o.take_corr_metrics() == {}  # read once per step


def test_sequence_is_weight_is_the_product_over_the_samples_steps():
    o = ops(
        *DECOUPLED,
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_threshold=5.0",
    )
    b = batch(torch.log(torch.tensor([[1.5, 2.0], [0.5, 0.5]])), [True, True])
    o.rollout_correction(b, torch.zeros(2, 2))
    torch.testing.assert_close(b.batch["rollout_is_weights"], torch.tensor([[3.0, 3.0], [0.25, 0.25]]))


def test_losses_multiply_each_clipped_term_by_its_weight():
    lp = torch.tensor([0.1, -0.2], requires_grad=True)
    old, adv, keep = torch.zeros(2), torch.tensor([1.0, -1.0]), torch.tensor([True, True])
    plain, _ = flow_grpo_loss(lp, old, adv, keep, clip_ratio=10.0)
    weighted, _ = flow_grpo_loss(lp, old, adv, keep, clip_ratio=10.0, is_weights=torch.tensor([2.0, 0.0]))
    first_only, _ = flow_grpo_loss(lp, old, adv, torch.tensor([True, False]), clip_ratio=10.0)
    torch.testing.assert_close(weighted, first_only)  # 2 x (first term) / 2 kept = first term alone
    assert not torch.allclose(plain, weighted)
    tok = torch.tensor([[0.1, 0.3]], requires_grad=True)
    w = torch.tensor([[1.0, 0.5]])
    loss_w, _ = grpo_token_loss(
        tok, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), clip_ratio=10.0, rollout_is_weights=w
    )
    torch.testing.assert_close(loss_w, -(torch.exp(tok) * w).mean())


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        (["algorithm.rollout_correction.rollout_is=token"], "rollout_is", "bypass_mode=false"),
        ([*DECOUPLED, "algorithm.rollout_correction.rollout_is=geometric"], "rollout_is", "token or sequence"),
        (
            [
                *DECOUPLED,
                "algorithm.rollout_correction.rollout_rs=token_k9",
                "algorithm.rollout_correction.rollout_rs_threshold=2",
            ],
            "rollout_rs",
            "token_k1",
        ),
        ([*DECOUPLED, "algorithm.rollout_correction.rollout_rs=token_k1"], "rollout_rs_threshold", "0.5_2.0"),
        (
            [
                *DECOUPLED,
                "algorithm.rollout_correction.rollout_is=token",
                "algorithm.rollout_correction.rollout_is_threshold=big",
            ],
            "rollout_correction",
            "lower_upper",
        ),
        (
            ["actor_rollout_ref.rollout.nnodes=1", "async_reward.fully_async=true", *DECOUPLED],
            "bypass_mode",
            "rollout_is=token",
        ),
    ],
)
def test_refused_rollout_correction_names_the_fix(overrides, key, fix):
    with pytest.raises(ConfigError, match=key) as e:
        cfg(*overrides)
    assert fix in str(e.value)


def test_fully_async_decoupled_mode_composes():
    c = cfg(
        "actor_rollout_ref.rollout.nnodes=1",
        "async_reward.fully_async=true",
        *DECOUPLED,
        "algorithm.rollout_correction.rollout_is=sequence",
        'algorithm.rollout_correction.rollout_is_threshold="0.5_2.0"',
    )
    assert c.algorithm.rollout_correction.rollout_is == "sequence"
