import math

import pytest
import torch

from omni_async.algos.advantages import group_advantages
from omni_async.algos.loss import flow_grpo_loss


def test_group_advantages_hand_computed():
    scores = torch.tensor([1.0, 3.0, 0.0, 0.0, 5.0])
    uids = ["a", "a", "b", "b", "c"]
    adv, kept = group_advantages(scores, uids, epsilon=0.0)
    sd = math.sqrt(2.0)  # unbiased std of [1, 3]
    assert torch.allclose(adv[:2], torch.tensor([-1 / sd, 1 / sd]))
    assert torch.equal(adv[2:4], torch.zeros(2))  # zero-std group: no signal, even with eps=0
    assert kept.tolist() == [True, True, True, True, False]  # singleton group dropped
    assert adv[4] == 0


def test_masked_samples_leave_group_stats_and_small_groups_drop():
    scores = torch.tensor([1.0, 3.0, 100.0, 2.0, 4.0])
    uids = ["a", "a", "a", "b", "b"]
    valid = torch.tensor([True, True, False, True, False])
    adv, kept = group_advantages(scores, uids, valid)
    assert kept.tolist() == [True, True, False, False, False]  # b keeps one sample -> dropped
    assert torch.allclose(adv[:2], torch.tensor([-1.0, 1.0]) / math.sqrt(2.0), atol=1e-5)


def test_global_std_dr_grpo_and_clip():
    scores = torch.tensor([0.0, 2.0, 10.0, 14.0])
    uids = ["a", "a", "b", "b"]
    adv, _ = group_advantages(scores, uids, global_std=True, epsilon=0.0)
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, -2.0, 2.0]) / scores.std())
    adv, _ = group_advantages(scores, uids, norm_by_std=False)
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, -2.0, 2.0]))
    adv, _ = group_advantages(scores, uids, norm_by_std=False, adv_clip_max=1.5)
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, -1.5, 1.5]))


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
    loss, m = flow_grpo_loss(lp, torch.zeros(3), torch.tensor([1.0, 1.0, 100.0]), torch.tensor([1, 1, 0]),
                             clip_ratio=0.2, kl=torch.tensor([0.2, 0.4, 50.0]), kl_coef=0.5)
    assert loss.item() == pytest.approx(-1.0 + 0.5 * 0.3)
    assert m["actor/kl_loss"] == pytest.approx(0.3)
