"""Diffusion-DPO pinned to verl-omni's formula (a1139ba: ``DPOLoss.compute_loss``, ``build_online_dpo_pair_indices``;
``sample_noise_and_timesteps``; ``docs/algo/diffusion_dpo.md``), written out below pair by pair in plain Python from
verl-omni's statement, independently of the implementation, on random fp64 tensors; and the registry's dispatch."""

import math

import pytest
import torch

from omni_async.algos.dpo import dpo_loss, logit_normal_u, preference_pairs, train_index
from omni_async.algos.loss_modes import FINAL_LATENTS, LOSS_MODES

torch.set_num_threads(1)
F64 = torch.float64


def reference_dpo(v_theta, v_ref, x0, noise, beta):
    """verl-omni's docs: Delta(x) = ||v_theta - u||^2 - ||v_ref - u||^2 (means over the element), u = eps - x0;
    L = -mean_pairs log sigmoid(-beta/2 (Delta(x^w) - Delta(x^l))); implicit rewards -beta/2 Delta."""
    n = v_theta.shape[0]
    losses, accs, chosen, rejected = [], [], [], []
    for p in range(n // 2):
        deltas = []
        for i in (2 * p, 2 * p + 1):
            u = (noise[i] - x0[i]).flatten().tolist()
            vt, vr = v_theta[i].flatten().tolist(), v_ref[i].flatten().tolist()
            e_theta = sum((a - b) ** 2 for a, b in zip(vt, u, strict=True)) / len(u)
            e_ref = sum((a - b) ** 2 for a, b in zip(vr, u, strict=True)) / len(u)
            deltas.append(e_theta - e_ref)
        z = -beta / 2 * (deltas[0] - deltas[1])
        losses.append(-math.log(1 / (1 + math.exp(-z))))
        accs.append(1.0 if z > 0 else 0.0)
        chosen.append(-beta / 2 * deltas[0])
        rejected.append(-beta / 2 * deltas[1])
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return mean(losses), mean(accs), mean(chosen), mean(rejected)


def test_dpo_loss_is_verl_omnis_formula_and_its_gradient_favours_the_chosen_sample():
    g = torch.Generator().manual_seed(0)
    shape = (6, 4, 3, 3)  # 3 pairs
    x0, noise, v_ref = (torch.randn(shape, generator=g, dtype=F64) for _ in range(3))
    v_theta = (v_ref + 0.05 * torch.randn(shape, generator=g, dtype=F64)).requires_grad_(True)
    beta = 100.0
    loss, m = dpo_loss(v_theta, v_ref, x0, noise, beta=beta)
    want, acc, chosen, rejected = reference_dpo(v_theta.detach(), v_ref, x0, noise, beta)
    assert abs(float(loss.detach()) - want) < 1e-10
    assert abs(float(m["actor/dpo_loss"]) - want) < 1e-10
    assert abs(float(m["actor/implicit_acc"]) - acc) < 1e-6
    assert abs(float(m["rewards/chosen"]) - chosen) < 1e-9 and abs(float(m["rewards/rejected"]) - rejected) < 1e-9
    assert abs(float(m["rewards/margins"]) - (chosen - rejected)) < 1e-9
    # A step down the gradient lowers the chosen rows' matching error and raises the rejected rows'.
    loss.backward()
    u = noise - x0
    err = lambda v: ((v - u) ** 2).flatten(1).mean(1)  # noqa: E731
    before = err(v_theta.detach())
    after = err(v_theta.detach() - 1e-3 * v_theta.grad)
    assert (after[0::2] < before[0::2]).all() and (after[1::2] > before[1::2]).all()


def test_dpo_loss_refuses_an_odd_batch():
    x = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="even"):
        dpo_loss(x, x, x, x, beta=1.0)


def test_pairs_are_each_groups_best_and_worst_kept_sample_in_first_appearance_order():
    uids = ["b", "a", "b", "a", "b", "c", "a", "c", "d"]
    scores = [0.2, 0.5, 0.9, 0.5, 0.1, 0.3, 0.7, 0.3, 1.0]
    kept = [True, True, True, True, False, True, True, True, True]
    # b: 0.9 (row 2) over 0.2 (row 0; row 4 failed); a: 0.7 (row 6) over the later of the tied 0.5s (row 3: a stable
    # sort, highest first, keeps row 1 before row 3, and the last is taken); c: a tie, first then last; d: alone.
    assert preference_pairs(uids, scores, kept) == [(2, 0), (6, 3), (5, 7)]
    assert preference_pairs(["a", "a"], [0.0, 1.0], [True, False]) == []  # one scored member: no pair


def test_training_timestep_is_a_logit_normal_index_into_the_training_grid():
    """diffusers' logit_normal (mean 0, std 1): u = sigmoid(n); k = floor(u T), as verl-omni indexes its scheduler."""
    g = torch.Generator().manual_seed(3)
    us = torch.tensor([logit_normal_u(g) for _ in range(4000)], dtype=F64)
    logits = torch.log(us / (1 - us))
    assert abs(float(logits.mean())) < 0.06 and abs(float(logits.std()) - 1) < 0.05
    assert train_index(torch.tensor([0.0, 0.5, 0.9999, 1.0], dtype=F64), 1000).tolist() == [0, 500, 999, 999]


def test_dpo_is_a_built_final_latent_loss_with_its_own_backward():
    mode = LOSS_MODES["dpo"]
    assert mode.built and mode.data_path == FINAL_LATENTS and mode.backward == "dpo" and mode.algorithm == "dpo"
