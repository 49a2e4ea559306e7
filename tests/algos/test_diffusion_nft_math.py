"""DiffusionNFT's math against the reference formulas, computed independently on the same tensors."""

import pytest
import torch

from omni_async.algos.diffusion_nft import (
    DECAY_SCHEDULES,
    ema_update_,
    forward_noised,
    nft_loss,
    old_policy_decay,
    optimality_probability,
    refreshes_after,
    train_steps,
)
from omni_async.algos.staleness import feedback_rounds


def test_optimality_probability_continuous_is_half_plus_half_clipped():
    adv = torch.tensor([-12.0, -5.0, -2.5, 0.0, 1.0, 5.0, 7.0])
    r = optimality_probability(adv, adv_clip_max=5.0)
    want = [0.5 + 0.5 * max(-1.0, min(1.0, a / 5.0)) for a in adv.tolist()]
    assert r.tolist() == pytest.approx(want)
    assert r.tolist() == pytest.approx([0.0, 0.0, 0.25, 0.5, 0.6, 1.0, 1.0])


@pytest.mark.parametrize(
    ("mode", "want"),
    [
        ("positive_only", [0.5, 0.5, 0.5, 0.6, 1.0]),
        ("negative_only", [0.0, 0.25, 0.5, 0.5, 0.5]),
        ("one_only", [0.5, 0.5, 0.5, 0.6, 0.6]),  # r = 1/2 + [A > 0] / (2c): {1/2, 0.6} at c = 5
        ("binary", [0.4, 0.4, 0.5, 0.6, 0.6]),  # r = 1/2 + sign(A) / (2c): {0.4, 1/2, 0.6} at c = 5
    ],
)
def test_optimality_probability_adv_modes(mode, want):
    adv = torch.tensor([-9.0, -2.5, 0.0, 1.0, 8.0])
    assert optimality_probability(adv, adv_clip_max=5.0, adv_mode=mode).tolist() == pytest.approx(want)


@pytest.mark.parametrize("c", [1.0, 2.0, 5.0, 10.0])
def test_one_only_and_binary_move_r_by_one_over_2c_as_nvlabs_and_verl_omni(c):
    """NVlabs ``train_nft_sd3.py`` / verl-omni ``_advantage_to_reward_prob``: the indicator / sign replaces the
    clipped advantage, then ``r = (a / c) / 2 + 1/2``: r moves ``1 / (2c)`` off 1/2, whatever ``|A|``."""
    adv = torch.tensor([-30.0, -0.01, 0.0, 0.01, 30.0])
    step = 1.0 / (2.0 * c)
    one_only = optimality_probability(adv, adv_clip_max=c, adv_mode="one_only").tolist()
    binary = optimality_probability(adv, adv_clip_max=c, adv_mode="binary").tolist()
    assert one_only == pytest.approx([0.5, 0.5, 0.5, 0.5 + step, 0.5 + step])
    assert binary == pytest.approx([0.5 - step, 0.5 - step, 0.5, 0.5 + step, 0.5 + step])


def test_unknown_adv_mode_names_the_choices():
    with pytest.raises(ValueError, match="continuous, positive_only"):
        optimality_probability(torch.zeros(2), adv_clip_max=5.0, adv_mode="all")


def test_forward_noised_is_the_rectified_flow_interpolant():
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    sigma = torch.tensor([0.0, 0.3, 1.0])
    xt = forward_noised(x0, sigma, eps)
    for i, s in enumerate(sigma.tolist()):
        assert torch.allclose(xt[i], (1 - s) * x0[i] + s * eps[i])
    # the flow-matching target eps - x0 is dx_t/dt
    assert torch.allclose(forward_noised(x0, sigma + 1e-3, eps) - xt, 1e-3 * (eps - x0), atol=1e-5)


def test_train_steps_is_a_subset_of_the_fraction_and_per_generator():
    steps = train_steps(10, 0.45, torch.Generator().manual_seed(3))
    assert len(steps) == 4 and len(set(steps.tolist())) == 4 and all(0 <= s < 10 for s in steps.tolist())
    assert train_steps(10, 0.45, torch.Generator().manual_seed(3)).tolist() == steps.tolist()
    assert sorted(train_steps(10, 1.0, torch.Generator().manual_seed(1)).tolist()) == list(range(10))
    assert len(train_steps(10, 0.01, torch.Generator().manual_seed(1))) == 1  # at least one step


def _paper_loss(v_theta, v_old, x0, eps, sigma, r, beta, c, w_min, keep):
    """The paper's form, in fp64: r ||v+ - v||^2 + (1 - r) ||v- - v||^2 with v = eps - x0, each term weighted by
    t^2 / w (w = mean |t (v - v+-)|, clipped below at w_min), scaled by c / beta, averaged over kept samples."""
    total, n = 0.0, 0
    for i in range(len(x0)):
        if not keep[i]:
            continue
        t = float(sigma[i])
        v = (eps[i] - x0[i]).double()
        vp = (1 - beta) * v_old[i].double() + beta * v_theta[i].double()
        vn = (1 + beta) * v_old[i].double() - beta * v_theta[i].double()
        wp = max((t * (v - vp)).abs().mean().item(), w_min)
        wn = max((t * (v - vn)).abs().mean().item(), w_min)
        pos = (t**2 * (vp - v) ** 2).mean().item() / wp
        neg = (t**2 * (vn - v) ** 2).mean().item() / wn
        total += (float(r[i]) * pos + (1 - float(r[i])) * neg) * c / beta
        n += 1
    return total / n


def test_nft_loss_equals_the_papers_weighted_form_and_its_gradient():
    g = torch.Generator().manual_seed(7)
    shape = (4, 6, 3)
    x0, eps = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    v_old = torch.randn(shape, generator=g)
    v_theta = (v_old + 0.1 * torch.randn(shape, generator=g)).requires_grad_(True)
    sigma = torch.tensor([0.9, 0.5, 0.2, 0.7])
    r = torch.tensor([1.0, 0.25, 0.5, 0.0])
    keep = torch.tensor([True, True, False, True])
    xt = forward_noised(x0, sigma, eps)
    loss, m = nft_loss(v_theta, v_old, x0, xt, sigma, r, keep, mix_beta=0.1, adv_clip_max=5.0, adaptive_weight_min=1e-5)
    want = _paper_loss(v_theta.detach(), v_old, x0, eps, sigma, r, 0.1, 5.0, 1e-5, keep.tolist())
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
    assert float(m["actor/policy_loss"]) == pytest.approx(want, rel=1e-5)
    assert float(m["actor/reward_prob_mean"]) == pytest.approx((1.0 + 0.25 + 0.0) / 3)
    # Gradient: d/dv_theta of the same fp64 form (weights held constant), by autograd on an independent graph.
    loss.backward()
    vt = v_theta.detach().double().requires_grad_(True)
    total = 0.0
    for i in [0, 1, 3]:
        t, v = float(sigma[i]), (eps[i] - x0[i]).double()
        vp = 0.9 * v_old[i].double() + 0.1 * vt[i]
        vn = 1.1 * v_old[i].double() - 0.1 * vt[i]
        wp = max((t * (v - vp)).abs().mean().item(), 1e-5)
        wn = max((t * (v - vn)).abs().mean().item(), 1e-5)
        total = total + (float(r[i]) * (t**2 * (vp - v) ** 2).mean() / wp) * 50
        total = total + ((1 - float(r[i])) * (t**2 * (vn - v) ** 2).mean() / wn) * 50
    (total / 3).backward()
    assert torch.allclose(v_theta.grad.double(), vt.grad, rtol=1e-4, atol=1e-7)
    assert v_theta.grad[2].abs().max() == 0  # a masked sample contributes nothing


def test_nft_loss_at_theta_equal_old_pulls_toward_good_samples():
    """At v_theta = v_old both implicit policies are v_old; the gradient moves v_theta toward v on a sample with r=1
    and away from it with r=0 (the negative branch's -beta)."""
    x0, eps = torch.zeros(2, 4), torch.ones(2, 4)  # v = eps - x0 = 1
    v_old = torch.zeros(2, 4)
    v_theta = v_old.clone().requires_grad_(True)
    sigma = torch.tensor([0.5, 0.5])
    loss, _ = nft_loss(
        v_theta, v_old, x0, forward_noised(x0, sigma, eps), sigma, torch.tensor([1.0, 0.0]), torch.ones(2),
        mix_beta=0.5, adv_clip_max=1.0, adaptive_weight_min=1e-5,
    )  # fmt: skip
    loss.backward()
    assert (v_theta.grad[0] < 0).all()  # descending raises v_theta toward v = 1
    assert (v_theta.grad[1] > 0).all()  # and lowers it on the bad sample


def test_ref_kl_adds_mean_squared_prediction_distance():
    g = torch.Generator().manual_seed(1)
    x0, eps, v_old, v_ref = (torch.randn(3, 5, generator=g) for _ in range(4))
    v_theta = torch.randn(3, 5, generator=g)
    sigma, r, keep = torch.tensor([0.3, 0.6, 0.9]), torch.tensor([0.2, 0.5, 0.9]), torch.tensor([1, 0, 1])
    kw = dict(mix_beta=0.3, adv_clip_max=5.0, adaptive_weight_min=1e-5)
    xt = forward_noised(x0, sigma, eps)
    base, _ = nft_loss(v_theta, v_old, x0, xt, sigma, r, keep, **kw)
    with_ref, m = nft_loss(v_theta, v_old, x0, xt, sigma, r, keep, v_ref=v_ref, ref_kl_coef=0.01, **kw)
    kl = (((v_theta - v_ref) ** 2).mean(1)[[0, 2]]).mean()
    assert float(m["actor/ref_kl_loss"]) == pytest.approx(float(kl))
    assert float(with_ref) == pytest.approx(float(base) + 0.01 * float(kl), rel=1e-6)


@pytest.mark.parametrize(
    "schedule", [s for s in DECAY_SCHEDULES if s not in ("linear_to_0_3", "delayed_linear_to_0_999_x15")]
)  # AWM's: test_awm_math; the compressed ramp: below
def test_decay_schedules_are_nvlabs_return_decay(schedule):
    # NVlabs' return_decay(step, decay_type): (flat, uprate, uphold) per type 0 / 1 / 2
    flat, uprate, uphold = {"copy": (0, 0.0, 0.0), "linear_to_0_5": (0, 0.001, 0.5)}.get(schedule, (75, 0.0075, 0.999))
    for step in [0, 1, 2, 74, 75, 76, 100, 208, 300, 1000]:
        want = 0.0 if step < flat else min((step - flat) * uprate, uphold)
        assert old_policy_decay(step, schedule) == pytest.approx(want)
    assert old_policy_decay(500, schedule, fixed=0.9) == 0.9


def test_compressed_delayed_ramp_is_nvlabs_ramp_at_step_times_15():
    # d_k = 0 for k < 5, then min(0.1125 (k - 5), 0.999): NVlabs' decay_type 2 evaluated at 15 k
    want = {1: 0.0, 4: 0.0, 5: 0.0, 6: 0.1125, 7: 0.225, 10: 0.5625, 13: 0.9, 14: 0.999, 20: 0.999}
    for step, d in want.items():
        assert old_policy_decay(step, "delayed_linear_to_0_999_x15") == pytest.approx(d)
        assert old_policy_decay(step, "delayed_linear_to_0_999_x15") == pytest.approx(
            old_policy_decay(15 * step, "delayed_linear_to_0_999")
        )


def test_the_ramp_counts_feedback_rounds_so_a_late_run_copies_for_as_many_rounds():
    ramp = "delayed_linear_to_0_999_x15"
    # lock-step: step k (1-based) trains version k - 1, whatever the mix of groups
    assert [feedback_rounds([k - 1] * 8) for k in range(1, 6)] == [1, 2, 3, 4, 5]
    # fully async at staleness 3 (a 32-group window, 8 groups a step): steps 1-4 train version 0's groups, then lag 3;
    # a step spanning two versions counts the newer
    versions = {1: [0] * 8, 2: [0] * 8, 3: [0] * 8, 4: [0] * 8, 5: [1] * 8, 8: [4] * 8, 9: [4] * 3 + [5] * 5}
    rounds = {k: feedback_rounds(v) for k, v in versions.items()}
    assert rounds == {1: 1, 2: 1, 3: 1, 4: 1, 5: 2, 8: 5, 9: 6}
    # the old policy still copies at step 8 (5 rounds, as a lock-step run's step 5), where the step count would
    # already hold it by a third
    assert old_policy_decay(rounds[8], ramp) == 0.0 and old_policy_decay(8, ramp) == pytest.approx(0.3375)
    assert old_policy_decay(rounds[9], ramp) == pytest.approx(old_policy_decay(6, ramp))
    with pytest.raises(ValueError, match="at least one group"):
        feedback_rounds([])


def test_decay_examples_and_refresh_interval():
    assert old_policy_decay(76, "delayed_linear_to_0_999") == pytest.approx(0.0075)
    assert old_policy_decay(10_000, "delayed_linear_to_0_999") == pytest.approx(0.999)
    assert old_policy_decay(400, "linear_to_0_5") == pytest.approx(0.4)
    assert [refreshes_after(k, 2) for k in range(1, 6)] == [False, True, False, True, False]
    with pytest.raises(ValueError, match="copy, linear_to_0_5"):
        old_policy_decay(1, "cosine")


def test_ema_update_moves_old_by_one_minus_decay_of_the_gap():
    old, new = [torch.zeros(3), torch.ones(2, 2)], [torch.full((3,), 2.0), torch.full((2, 2), -1.0)]
    gaps = [n - o for o, n in zip(old, new, strict=True)]
    before = [o.clone() for o in old]
    ema_update_(old, new, 0.75)
    for o, b, gap in zip(old, before, gaps, strict=True):
        assert torch.allclose(o - b, 0.25 * gap)
    ema_update_(old, new, 0.0)  # decay 0: a copy
    assert all(torch.equal(o, n) for o, n in zip(old, new, strict=True))
    with pytest.raises(ValueError):
        ema_update_(old, new, 1.5)


def test_lagged_old_policy_distance_is_within_the_ema_bound():
    """A sample drawn by old_g and trained at version v (fully async lag v - g): ||old_v - old_g|| is at most
    sum_k (1 - d_k) ||theta_k - old_k|| over the refreshes in between, the bound the loss's docstring states."""
    g = torch.Generator().manual_seed(0)
    old = [torch.zeros(50)]
    theta = old[0].clone()
    history, moves = [old[0].clone()], []
    for k in range(1, 13):
        theta = theta + 0.1 * torch.randn(50, generator=g)  # an update
        d = old_policy_decay(k, "linear_to_0_5", None) + 0.3
        moves.append((1 - d) * float((theta - old[0]).norm()))
        ema_update_(old, [theta], d)
        history.append(old[0].clone())
    for lag in (1, 2, 3):
        for v in range(lag, len(history)):
            dist = float((history[v] - history[v - lag]).norm())
            assert dist <= sum(moves[v - lag : v]) + 1e-6
            if lag == 1:  # one refresh: exactly (1 - d) of the gap
                assert dist == pytest.approx(moves[v - 1], rel=1e-5)
