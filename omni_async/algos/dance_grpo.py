"""DanceGRPO (arXiv 2505.07818) as verl-omni computes it: DanceGRPO's SDE step on the sampled window, trained with
FlowGRPO's advantage and clipped loss.

verl-omni at a1139ba splits DanceGRPO over three places, and differs from this project's FlowGRPO in one of them:

- **The SDE step** (``verl_omni/pipelines/schedulers/flow_match_sde.py``, ``sde_type == "dance_sde"``, "DanceGRPO
  SDE step from https://github.com/XueZeyue/DanceGRPO"). With ``dt = sigma_next - sigma < 0``, ``eta =
  noise_level``, the model's velocity ``v`` and ``x0^ = x - sigma v``::

      score = -(x - (1 - sigma) x0^) / sigma^2                  (the noised-data score estimate)
      mu    = x + dt v - (eta^2 / 2) score dt                    (the Euler step plus the score correction)
      s     = eta sqrt(-dt)                                      (the transition std; verl-omni's std_dev_t)
      log_prob = mean_dims[ -(x_next - mu)^2 / (2 s^2) - log s - log sqrt(2 pi) ]   (the full Gaussian density)

  Since ``x - (1 - sigma) x0^ = sigma (x + (1 - sigma) v)``, ``mu`` is Flow-GRPO's ``sde`` mean with its
  ``std_dev_t = noise_level sqrt(sigma / (1 - sigma))`` replaced by the constant ``eta``::

      mu = x (1 + eta^2 / (2 sigma) dt) + v (1 + eta^2 (1 - sigma) / (2 sigma)) dt

  which is what :func:`dance_sde_mean_std` computes (finite at ``sigma = 1``, where Flow-GRPO's ``sde`` needs the
  ``sigma_max`` guard; the last step, ``sigma_next = 0``, has ``s = eta sqrt(sigma) > 0``). The KL to the reference
  (``sde.kl_to_reference``, verl-omni's ``KLLoss``) divides by ``2 s^2``: verl-omni's step returns ``s`` as its
  ``std_dev_t``. ``noise_level = 0`` is the Euler step, with log-prob 0 (a point mass), as for the other SDEs.
- **The loss**: verl-omni registers ``dance_grpo`` to its ``FlowGRPOLoss`` (``verl_omni/trainer/diffusion/
  diffusion_algos.py``, ``@register_diffusion_loss("dance_grpo")`` on the class of ``flow_grpo``): per window step,
  with the advantages clipped to ``+-adv_clip_max`` and ``eps = clip_ratio``::

      rho_i = exp(logp_theta_i - logp_old_i)
      L     = mean_i max(-A_i rho_i, -A_i clip(rho_i, 1 - eps, 1 + eps))   (+ kl_loss_coef * KL)

  :func:`dance_grpo_loss` is ``loss.flow_grpo_loss`` (the advantage clip happens where this project clips every
  window loss's advantages: when the batch is built, ``LossMode.clips_advantages``).
- **The advantage**: ``algorithm.adv_estimator=dance_grpo`` is registered to the same function as ``flow_grpo``
  (``compute_flow_grpo_outcome_advantage``): group-mean-centred rewards over the batch's (``global_std``) or the
  group's std, ``algos.advantages``.
- **Which steps train**: the SDE window, as for FlowGRPO (``rollout.algo.sde_window_size`` steps drawn inside
  ``sde_window_range``, ``sde.sde_window``); verl-omni's recipe: 2 steps inside ``[0, 5)`` of 10. DanceGRPO's own
  ``timestep_fraction`` (a random subset of all the steps) is not what verl-omni runs.

What verl-omni adds for its Wan 2.2 rollout only (``pipelines/wan22_dance_grpo``) is the pipeline's schedule:
``sigma = shift t / (1 + (shift - 1) t)`` on ``t = linspace(1, 0, N + 1)``, ``pipeline.shift`` (default 5.0); here a
pipeline samples with its own scheduler's sigmas (``models.diffusion_policy``), for DanceGRPO as for FlowGRPO.
"""

from __future__ import annotations

import torch

from omni_async.algos.loss import flow_grpo_loss

# verl-omni's sde_type for DanceGRPO's step (rollout.algo.sde_type)
DANCE_SDE = "dance_sde"


def dance_sde_mean_std(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    noise_level: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DanceGRPO's step Gaussian ``(mu, s)`` for ``x_sigma -> x_sigma_next`` (module docstring); ``sigma`` and
    ``sigma_next`` broadcast against ``sample`` (``[B, 1, ...]`` or 0-d). ``s`` has the shape of ``mu``."""
    dt = sigma_next - sigma
    eta2 = noise_level**2
    mean = sample * (1 + eta2 / (2 * sigma) * dt) + velocity * (1 + eta2 * (1 - sigma) / (2 * sigma)) * dt
    std = (noise_level * torch.sqrt(torch.clamp(-dt, min=0.0))).expand_as(mean)
    return mean, std


# DanceGRPO's per-window-step loss is verl-omni's ``FlowGRPOLoss`` itself (its loss registry maps ``dance_grpo`` to it;
# module docstring): ``loss.flow_grpo_loss`` on the log-probs of DanceGRPO's step, the same function under its name.
dance_grpo_loss = flow_grpo_loss
