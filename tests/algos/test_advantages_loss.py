import math

import numpy as np
import pytest
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

from omni_async.algos.advantages import group_advantages
from omni_async.algos.loss import flow_grpo_loss


def test_group_advantages_hand_computed():
    # Default = flow_grpo's PerPromptStatTracker: biased (population) std, eps 1e-4.
    scores = torch.tensor([1.0, 3.0, 0.0, 0.0, 5.0, 1.0, 2.0, 6.0])
    uids = ["a", "a", "b", "b", "c", "d", "d", "d"]
    adv, kept = group_advantages(scores, uids)
    # a: mean 2, biased std sqrt(((1-2)^2 + (3-2)^2) / 2) = 1
    assert adv[:2].tolist() == pytest.approx([-1 / 1.0001, 1 / 1.0001])
    assert adv[2:4].tolist() == [0.0, 0.0]  # zero-std group: no signal
    assert kept.tolist() == [True, True, True, True, False, True, True, True]  # singleton group dropped
    assert adv[4] == 0
    # d: mean 3, deviations (-2, -1, 3), biased variance (4 + 1 + 9) / 3 = 14 / 3
    sd = math.sqrt(14 / 3)
    assert adv[5:].tolist() == pytest.approx([-2 / (sd + 1e-4), -1 / (sd + 1e-4), 3 / (sd + 1e-4)], rel=1e-6)


def test_zero_std_group_is_zero_even_without_eps():
    adv, _ = group_advantages(torch.tensor([2.0, 2.0, 1.0, 3.0]), ["a", "a", "b", "b"], epsilon=0.0)
    assert adv.tolist() == pytest.approx([0.0, 0.0, -1.0, 1.0])


def test_unbiased_std_is_verls_grpo():
    scores = torch.tensor([1.0, 2.0, 6.0, 1.0, 3.0])
    uids = ["d", "d", "d", "a", "a"]
    adv, _ = group_advantages(scores, uids, std_unbiased=True, epsilon=1e-6)
    # d: unbiased variance (4 + 1 + 9) / 2 = 7; a: (1 + 1) / 1 = 2
    sd, sa = math.sqrt(7.0), math.sqrt(2.0)
    want = [-2 / (sd + 1e-6), -1 / (sd + 1e-6), 3 / (sd + 1e-6), -1 / (sa + 1e-6), 1 / (sa + 1e-6)]
    assert adv.tolist() == pytest.approx(want, rel=1e-6)
    verl_adv, _ = compute_grpo_outcome_advantage(scores[:, None], torch.ones(5, 1), np.array(uids, dtype=object))
    assert torch.allclose(adv, verl_adv[:, 0])


def test_masked_samples_leave_group_stats_and_small_groups_drop():
    scores = torch.tensor([1.0, 3.0, 100.0, 2.0, 4.0])
    uids = ["a", "a", "a", "b", "b"]
    valid = torch.tensor([True, True, False, True, False])
    adv, kept = group_advantages(scores, uids, valid)
    assert kept.tolist() == [True, True, False, False, False]  # b keeps one sample -> dropped
    assert adv.tolist() == pytest.approx([-1 / 1.0001, 1 / 1.0001, 0.0, 0.0, 0.0])  # a: biased std of [1, 3] = 1


def test_global_std_dr_grpo_and_clip():
    scores = torch.tensor([0.0, 2.0, 10.0, 14.0])
    uids = ["a", "a", "b", "b"]
    # batch mean 6.5, squared deviations 42.25 + 20.25 + 12.25 + 56.25 = 131
    adv, _ = group_advantages(scores, uids, global_std=True, epsilon=0.0)
    assert adv.tolist() == pytest.approx([x / math.sqrt(131 / 4) for x in (-1.0, 1.0, -2.0, 2.0)], rel=1e-6)
    adv, _ = group_advantages(scores, uids, global_std=True, std_unbiased=True, epsilon=0.0)
    assert adv.tolist() == pytest.approx([x / math.sqrt(131 / 3) for x in (-1.0, 1.0, -2.0, 2.0)], rel=1e-6)
    adv, _ = group_advantages(scores, uids, norm_by_std=False)
    assert adv.tolist() == pytest.approx([-1.0, 1.0, -2.0, 2.0])
    adv, _ = group_advantages(scores, uids, norm_by_std=False, adv_clip_max=1.5)
    assert adv.tolist() == pytest.approx([-1.0, 1.0, -1.5, 1.5])


def test_loss_ratio_one_on_first_inner_step():
    lp = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 0.5])
    loss, m = flow_grpo_loss(lp, lp.detach().clone(), adv, torch.ones(3), clip_ratio=0.2)
    assert m["actor/ratio_mean"] == pytest.approx(1.0) and m["actor/pg_clipfrac"] == 0.0
    assert loss.item() == pytest.approx(-(1.0 - 1.0 + 0.5) / 3)
    loss.backward()
    assert torch.allclose(lp.grad, -adv / 3)


def test_loss_clipping_hand_computed():
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 0.5, 1.5, 0.5]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, m = flow_grpo_loss(new, old, adv, torch.ones(4), clip_ratio=0.2)
    # per-sample max(-A r, -A clip(r)): [-1.2, -0.5, 1.5, 0.8]
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8) / 4)
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5)  # samples 0 and 3 are clipped
    assert m["actor/pg_clipfrac_higher"] == pytest.approx(0.25) and m["actor/pg_clipfrac_lower"] == pytest.approx(0.25)


def test_loss_mask_and_kl():
    lp = torch.zeros(3, requires_grad=True)
    loss, m = flow_grpo_loss(
        lp,
        torch.zeros(3),
        torch.tensor([1.0, 1.0, 100.0]),
        torch.tensor([1, 1, 0]),
        clip_ratio=0.2,
        kl=torch.tensor([0.2, 0.4, 50.0]),
        kl_coef=0.5,
    )
    assert loss.item() == pytest.approx(-1.0 + 0.5 * 0.3)
    assert m["actor/kl_loss"] == pytest.approx(0.3)


def test_loss_metrics_are_device_tensors_over_kept_samples():
    """Metrics stay 0-d tensors (read once after backward, not one sync each); the ratio's mean and unbiased std run
    over the kept samples only, and a step with none kept reads ratio 1, std 0."""
    new, old = torch.log(torch.tensor([1.5, 0.5, 1.2, 9.0])), torch.zeros(4)
    _, m = flow_grpo_loss(new, old, torch.ones(4), torch.tensor([1, 1, 1, 0]), clip_ratio=0.2)
    assert all(torch.is_tensor(v) and v.ndim == 0 and not v.requires_grad for v in m.values())
    kept = torch.tensor([1.5, 0.5, 1.2])
    assert float(m["actor/ratio_mean"]) == pytest.approx(float(kept.mean()))
    assert float(m["actor/ratio_std"]) == pytest.approx(float(kept.std()))
    _, m = flow_grpo_loss(new, old, torch.ones(4), torch.zeros(4), clip_ratio=0.2)
    assert float(m["actor/ratio_mean"]) == 1.0 and float(m["actor/ratio_std"]) == 0.0
    _, m = flow_grpo_loss(new[:1], old[:1], torch.ones(1), torch.ones(1), clip_ratio=0.2)
    assert float(m["actor/ratio_std"]) == 0.0
