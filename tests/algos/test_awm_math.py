"""AWM's math (``algos.awm``) against its formulas written out here per sample on the same tensors, and the sign of its
gradient: a positive advantage lowers the sample's matching error, a negative one raises it."""

import math

import pytest
import torch

from omni_async.algos.awm import GHUBER_DELTA, awm_loss, draw_train_steps, matching_log_prob, stratified_train_steps
from omni_async.algos.diffusion_nft import DECAY_SCHEDULES, forward_noised, old_policy_decay


def tensors(b: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (b, 3, 4, 4)
    x0, noise = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    sigma = torch.tensor([0.9, 0.5, 0.25, 0.7])[:b]
    target = noise - x0
    v = (target + 0.5 * torch.randn(shape, generator=g)).requires_grad_(True)  # a prediction near the target
    return v, x0, noise, sigma


def reference_lp(v: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, t: float, weighting: str, p: float) -> float:
    """The authors' compute_log_prob_awm for one sample, in float64 (their model_output.double())."""
    err = float(((v.detach().double() - (noise.double() - x0.double())) ** 2).mean())
    if weighting == "uniform":
        return -err
    return -(math.pow(err + 1e-10, p) - math.pow(1e-10, p)) * t / p


@pytest.mark.parametrize(("weighting", "p"), [("uniform", 0.25), ("ghuber", 0.25), ("ghuber", 0.5)])
def test_matching_log_prob_is_the_weighted_error(weighting, p):
    v, x0, noise, sigma = tensors()
    lp = matching_log_prob(v, noise - x0, sigma, weighting=weighting, ghuber_power=p)
    want = [reference_lp(v[i], x0[i], noise[i], float(sigma[i]), weighting, p) for i in range(len(v))]
    assert lp.tolist() == pytest.approx(want, rel=1e-5)
    assert GHUBER_DELTA == 1e-10
    with pytest.raises(ValueError, match="uniform, ghuber"):
        matching_log_prob(v, noise - x0, sigma, weighting="huber", ghuber_power=p)


def reference_loss(v, x0, noise, sigma, adv, mask, old_lp, v_ref, v_old, *, c, eps, lam_ref, lam_old, w, p) -> float:
    """L = mean_i max(-A^ rho, -A^ clip(rho)) + lam_ref mean (v - v_ref)^2 + lam_old mean (v - v_old)^2 over the
    kept samples, A^ = clip(A, -c, c) / c, rho = exp(lp - lp_old), written out per sample."""
    kept = [i for i in range(len(v)) if mask[i]]
    pg = ref = old = 0.0
    for i in kept:
        a = max(-c, min(c, float(adv[i]))) / c
        lp = reference_lp(v[i], x0[i], noise[i], float(sigma[i]), w, p)
        rho = math.exp(lp - float(old_lp[i]))
        pg += max(-a * rho, -a * min(max(rho, 1 - eps), 1 + eps))
        ref += float(((v[i] - v_ref[i]) ** 2).mean())
        old += float(((v[i] - v_old[i]) ** 2).mean())
    n = len(kept)
    return pg / n + lam_ref * ref / n + lam_old * old / n


def test_loss_is_the_reference_with_ratio_clip_and_both_velocity_terms():
    v, x0, noise, sigma = tensors()
    g = torch.Generator().manual_seed(1)
    adv = torch.tensor([7.0, -2.0, 0.5, -9.0])  # two beyond c = 5: clipped to +-1 after the scaling
    mask = torch.tensor([True, True, False, True])
    lp_now = matching_log_prob(v.detach(), noise - x0, sigma, weighting="ghuber", ghuber_power=0.25)
    old_lp = lp_now + torch.tensor([-0.3, 0.002, 0.0, 0.4])  # ratios e^0.3, ~1, -, e^-0.4
    v_ref, v_old = v.detach() + 0.1 * torch.randn(v.shape, generator=g), v.detach() - 0.2
    kw = {"adv_clip_max": 5.0, "clip_ratio": 0.2, "weighting": "ghuber", "ghuber_power": 0.25}
    loss, m = awm_loss(
        v, x0, noise, sigma, adv, mask, old_log_prob=old_lp, v_ref=v_ref, ref_kl_coef=0.01, v_old=v_old,
        old_kl_coef=1.0, **kw,
    )  # fmt: skip
    want = reference_loss(
        v.detach(), x0, noise, sigma, adv, mask, old_lp, v_ref, v_old, c=5.0, eps=0.2, lam_ref=0.01, lam_old=1.0,
        w="ghuber", p=0.25,
    )  # fmt: skip
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
    assert float(m["actor/total_loss"]) == pytest.approx(want, rel=1e-5)
    assert float(m["actor/old_kl_loss"]) == pytest.approx(0.04, rel=1e-5)  # v - v_old = 0.2 everywhere
    # sample 0 (A^ = 1, rho = e^0.3 > 1.2) and sample 3 (A^ = -1, rho = e^-0.4 < 0.8) moved past the clip in their
    # advantage's direction: they take the clipped branch
    assert float(m["actor/pg_clipfrac"]) == pytest.approx(2 / 3)
    err = ((v.detach() - (noise - x0)) ** 2).mean((1, 2, 3))
    assert float(m["actor/fm_loss"]) == pytest.approx(float(err[mask].mean()), rel=1e-6)
    # The clipped samples carry no policy gradient; the masked one none at all.
    pg, _ = awm_loss(v, x0, noise, sigma, adv, mask, old_log_prob=old_lp, **kw)
    (grad,) = torch.autograd.grad(pg, v)
    grad_pg = grad.abs().sum((1, 2, 3))
    assert grad_pg[0] == 0 and grad_pg[2] == 0 and grad_pg[3] == 0 and grad_pg[1] > 0


def test_without_old_log_prob_the_ratio_is_one_and_the_gradient_is_advantage_times_the_matching_gradient():
    """rho = exp(lp - sg(lp)) = 1: L_pg = -mean A^, grad L_pg = mean_i A^_i grad e_i (uniform weighting), so a gradient
    step lowers the error of a positive-advantage sample and raises it for a negative one."""
    v, x0, noise, sigma = tensors()
    adv = torch.tensor([5.0, -2.5, 1.0, -5.0])
    mask = torch.ones(4, dtype=torch.bool)
    loss, m = awm_loss(v, x0, noise, sigma, adv, mask, adv_clip_max=5.0, clip_ratio=1e-4, weighting="uniform")
    assert float(loss.detach()) == pytest.approx(-float((adv / 5).mean()))
    assert float(m["actor/ratio_mean"]) == 1.0 and float(m["actor/pg_clipfrac"]) == 0.0
    (grad,) = torch.autograd.grad(loss, v)
    target, d = noise - x0, v[0].numel()
    for i in range(4):  # d/dv_i of (1/4) A^_i mean (v_i - target_i)^2
        want = (adv[i] / 5) / 4 * 2 * (v[i].detach() - target[i]) / d
        assert torch.allclose(grad[i], want, atol=1e-7)
    err = ((v.detach() - target) ** 2).mean((1, 2, 3))
    stepped = ((v.detach() - 1.0 * grad - target) ** 2).mean((1, 2, 3))
    moved = (stepped - err).tolist()
    assert moved[0] < 0 and moved[2] < 0  # A > 0: matching error lowered
    assert moved[1] > 0 and moved[3] > 0  # A < 0: raised
    assert abs(moved[0]) > abs(moved[2])  # in proportion to |A|: A = 5 moves more than A = 1


def test_ghuber_damps_large_errors_and_weights_by_t():
    """ghuber's gradient in e is t e^(p - 1): at p = 0.25 a sample with 16x the error gets 1/8 the weight per unit
    error, and a sample at twice the sigma twice the weight."""
    e = torch.tensor([0.01, 0.16, 0.01], dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0.5, 0.5, 1.0], dtype=torch.float64)
    lp = -t * ((e + GHUBER_DELTA) ** 0.25 - GHUBER_DELTA**0.25) / 0.25
    (g,) = torch.autograd.grad(lp.sum(), e)
    assert float(g[1] / g[0]) == pytest.approx(16**-0.75, rel=1e-6) and float(g[2] / g[0]) == pytest.approx(2.0)


def test_zero_coefficients_leave_the_velocity_terms_out_and_forward_noise_matches():
    v, x0, noise, sigma = tensors()
    mask = torch.ones(4, dtype=torch.bool)
    _, m = awm_loss(v, x0, noise, sigma, torch.ones(4), mask, adv_clip_max=5.0, clip_ratio=0.2, v_ref=v, v_old=v)
    assert "actor/ref_kl_loss" not in m and "actor/old_kl_loss" not in m
    xt = forward_noised(x0, sigma, noise)  # the x_t the prediction was made at: its flow target is noise - x0
    assert torch.allclose((xt - x0) / sigma.view(-1, 1, 1, 1), noise - x0, atol=1e-5)


def test_awm_anchor_schedule_is_the_authors_linear_to_0_3():
    """kl_ema_decay_type=linear, kl_ema_decay=0.3: d_k = min(0.001 k, 0.3) after optimizer step k."""
    assert DECAY_SCHEDULES["linear_to_0_3"] == (0, 0.001, 0.3)
    for k in (1, 2, 150, 300, 301, 5000):
        assert old_policy_decay(k, "linear_to_0_3") == pytest.approx(min(0.001 * k, 0.3))


# ---- training steps: the authors' time_type=discrete_wo_init --------------------------------------------------
# Their OCR / GenEval recipe: N = 14 rollout steps, timestep_fraction 0.9 -> M = int(12.6) = 12, K = 6 strata with
# bounds b_k = 1 + 11 k / 6 = 1, 2.83, 4.67, 6.5, 8.33, 10.17, 12 -> floors 1, 2, 4, 6, 8, 10, 12: [lo_k, hi_k) =
# [1, 2), [2, 4), [4, 6), [6, 8), [8, 10), [10, 12); step_k = lo_k + floor(u_k (hi_k - lo_k)).
RECIPE_STRATA = [(1, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)]


@pytest.mark.parametrize("u", [[0.0] * 6, [0.49] * 6, [0.5] * 6, [0.999] * 6, [0.1, 0.6, 0.3, 0.9, 0.5, 0.75]])
def test_stratified_steps_are_the_authors_strata_at_their_recipe(u):
    got = stratified_train_steps(14, 6, 0.9, torch.tensor(u)).tolist()
    want = [lo + math.floor(uk * (hi - lo)) for (lo, hi), uk in zip(RECIPE_STRATA, u, strict=True)]
    assert got == want


def test_stratified_steps_never_train_step_0_nor_past_the_fraction_and_cover_every_stratum():
    seen: list[set[int]] = [set() for _ in range(6)]
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        for k, step in enumerate(draw_train_steps(14, 6, 0.9, g).tolist()):
            seen[k].add(step)
    assert seen == [set(range(lo, hi)) for lo, hi in RECIPE_STRATA]  # steps 1..11: not 0, not 12 or 13


@pytest.mark.parametrize(
    ("n", "k", "fraction", "want_lo"),
    [
        (10, 6, 0.9, [1, 2, 3, 5, 6, 7]),  # the main job's 10 steps: M = 9, b_k = 1 + 8 k / 6
        (10, 4, 1.0, [1, 3, 5, 7]),  # M = 10, b_k = 1 + 9 k / 4 = 1, 3.25, 5.5, 7.75, 10
        (4, 6, 0.9, [1, 1, 1, 2, 2, 2]),  # M = 3: strata narrower than a step give lo_k (steps repeat)
        (5, 3, 0.3, [1, 1, 1]),  # M = 1: every step is step 1
    ],
)
def test_stratified_steps_lower_bounds_are_floor_of_the_exact_bounds(n, k, fraction, want_lo):
    m = int(n * fraction)
    assert stratified_train_steps(n, k, fraction, torch.zeros(k)).tolist() == want_lo
    assert want_lo == [1 + (j * (m - 1)) // k for j in range(k)]  # floor(1 + j (M - 1) / K)
    top = stratified_train_steps(n, k, fraction, torch.full((k,), 0.999999)).tolist()
    assert all(1 <= s <= max(m - 1, 1) for s in top)


def test_stratified_steps_refuse_an_empty_range():
    for n, k, fraction in ((1, 6, 1.0), (10, 0, 0.9), (10, 6, 0.05)):
        with pytest.raises(ValueError, match="num_steps >= 2"):
            stratified_train_steps(n, k, fraction, torch.zeros(max(k, 1)))
