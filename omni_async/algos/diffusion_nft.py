"""DiffusionNFT (Zheng et al., arXiv 2509.16117): online RL on the forward (noising) process of a flow model.

The rollout draws clean samples ``x0`` with the lagging ``old`` policy (any solver; ODE here) and a reward scores
them. No log-probs, no SDE window: the update noises ``x0`` again at rollout timesteps and fits two implicit
policies to the flow-matching target, the positive one on good samples and the negative one on bad ones.

**Optimality probability** (paper Sec. 3.3 / Alg. 1; verl-omni ``DiffusionNFTLoss._advantage_to_reward_prob``)::

    A_i = (r_raw_i - mean_g(r_raw)) / (Z + eps)          group advantage, Z = group std or batch std
    r_i = 1/2 + 1/2 * clip(A_i / c, -1, 1)                c = diffusion_loss.adv_clip_max

The paper writes ``clip(A / Z, -1, 1)`` with ``Z`` a free normaliser; NVlabs' code and verl-omni normalise by the
std first and then by ``c`` (5 in every recipe), i.e. ``Z = c * std``. This module follows verl-omni. ``adv_mode``
(verl-omni's ``algorithm.adv_mode``; NVlabs' ``train.adv_mode``) reshapes ``A`` before the map: ``continuous``
(as above), ``positive_only`` (``A <- max(A, 0)``), ``negative_only`` (``A <- min(A, 0)``), ``one_only``
(``A <- [A > 0]``, so ``r = 1/2 + [A > 0] / (2c)``: 0.6 or 1/2 at ``c = 5``) and ``binary`` (``A <- sign(A)``, so
``r = 1/2 + sign(A) / (2c)``: 0.4, 1/2 or 0.6 at ``c = 5``). In the last two the indicator / sign replaces the
clipped advantage *before* the division by ``c``, as NVlabs' ``train_nft_sd3.py`` and verl-omni's
``_advantage_to_reward_prob`` do: ``r`` moves ``1 / (2c)`` off 1/2, not to 0 or 1.

**Forward process** (rectified flow, as the rollout's schedule): at sigma ``t = timestep / 1000``::

    x_t = (1 - t) * x0 + t * eps,      eps ~ N(0, I),      target velocity v = eps - x0

**Loss** (paper eq. 7 with its adaptive weighting; NVlabs ``train_nft_sd3.py``; verl-omni ``DiffusionNFTLoss``)::

    v+ = (1 - beta) * v_old + beta * v_theta             implicit positive policy     (beta = mix_beta)
    v- = (1 + beta) * v_old - beta * v_theta             implicit negative policy
    x0+ = x_t - t * v+,    x0- = x_t - t * v-            their x0 predictions
    w+ = max(mean_dims |x0+ - x0|, w_min),  w- likewise  adaptive weights, no gradient (w_min = adaptive_weight_min)
    L_i = (c / beta) * [ r_i * mean_dims (x0+ - x0)^2 / w+  +  (1 - r_i) * mean_dims (x0- - x0)^2 / w- ]
    L   = mean_i L_i + lambda * mean_i mean_dims (v_theta - v_ref)^2           (lambda = ref_kl_coef)

Since ``x0+ - x0 = t * (v - v+)``, the bracket is the paper's ``r ||v+ - v||^2 + (1 - r) ||v- - v||^2`` with each
term weighted by ``t^2 / w`` (the paper's adaptive x0-space weighting, Sec. 4 / App. B). The ``c / beta`` scale is
NVlabs' and verl-omni's (it keeps the gradient's size independent of beta and of the advantage clip).
``v_old`` and ``v_ref`` (the adapter-off model) carry no gradient. Means run over the kept samples (``mask``).

**Old policy** (NVlabs ``return_decay``; verl-omni ``old_policy_decay``): every ``old_policy_update_interval``
training steps, after step ``k`` (1-based)::

    old <- d_k * old + (1 - d_k) * theta,     d_k = 0 if k < k0 else min((k - k0) * rate, d_max)

with ``(k0, rate, d_max)`` per schedule (:data:`DECAY_SCHEDULES`), or ``d_k = algorithm.old_policy_decay`` when set.
``delayed_linear_to_0_999`` is ``(75, 0.0075, 0.999)``; ``delayed_linear_to_0_999_x15`` is the same ramp with time
compressed 15-fold for short runs, ``(5, 0.1125, 0.999)``: ``d_k = 0`` for ``k < 5``, ``min(0.1125 (k - 5), 0.999)``
after (0.999 from ``k = 14``).

The ramp's ``k`` counts rounds of feedback, not updates: ``k = 1 + g``, ``g`` the newest weights version among the
groups the step trains on (:func:`omni_async.algos.staleness.feedback_rounds`). In the references' synchronous loops,
and in every lock-step mode here, that is the step number. Trained late it is the step less the lag: at staleness 3
the first four steps all train on version 0's samples (the rollouter fills its window before the first sync) and
later ones on samples 3 versions old, so counting updates would start holding the sampler after two rounds of
feedback where a lock-step run gets five. The ramp is there to let the sampler follow the policy while rounds of
feedback improve it and then hold it (the paper's soft update); its clock is the rounds. The refresh interval still
counts steps. Measured on the CPU main job at staleness 3 (``docs/diffusion_nft.md``, "An eighth pass").

**Which v_old a late sample is trained against** (fully async, one-step-off: a sample drawn by the old policy of
version ``g`` is trained at version ``v > g``). The loss uses the trainer's *current* old policy, ``old_v``:

- The loss has no likelihood ratio to the sampling distribution, so nothing in it must be the drawing policy's.
  ``v_old`` is the anchor of the two implicit policies; the data enter only through ``x0`` (the target
  ``v = eps - x0``) and ``r``. The paper's improvement argument (Thm. 3.2) and NVlabs' off-policy remark hold for
  data from any policy close to the anchor; the anchor being the newest old keeps ``v+`` / ``v-`` within
  ``beta x (v_theta - v_old)`` of the policy the trainer holds now, which is what the update steps.
- It is what both references compute: NVlabs and verl-omni evaluate ``v_old`` with the ``old`` adapter at update
  time (in their synchronous loops that is also the drawing one). Keeping every drawing version instead would cost
  one old copy per version in flight on the trainer (``s + 1`` adapters), or the rollout evaluating ``v_old`` at
  the training timesteps and shipping it (``T`` extra forwards and ``T`` latents per sample: the payload NFT drops).
- Measured: the drawing version's old (kept per version in flight) on the CPU main job at staleness 3 learned slower
  early and no better at the end; its gradient at the live weights pulls every sample back toward the drawing
  weights by ``beta^2 (v_theta - v_old_g)`` (``docs/diffusion_nft.md``, "A seventh pass").

The difference is bounded by the EMA. A refresh moves the old weights by ``(1 - d_k)`` of their gap to the live
ones, ``old_{k+1} - old_k = (1 - d_k) (theta_k - old_k)``, so between the drawing and the training version::

    ||old_v - old_g|| <= sum_{k=g}^{v-1} (1 - d_k) ||theta_k - old_k||  <=  n_refresh x (1 - d_min) x max_k ||theta_k - old_k||

with ``n_refresh <= ceil((v - g) / old_policy_update_interval)`` refreshes in between; in prediction space
``||v_old_v - v_old_g|| <= L ||old_v - old_g||`` (``L`` the model's Lipschitz constant in its weights). Late in a
``delayed_linear_to_0_999`` run (``d = 0.999``) a lag of 3 moves the anchor by at most 0.3 % of the theta-old gap;
with ``copy`` (``d = 0``) by up to the whole gap per refresh, as Flow-GRPO's pi_old moves with lag. Each refresh's
move, ``(1 - d_k) ||theta_k - old_k||``, is logged as ``old_policy/moved_l2``, so the bound is measured per run.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from omni_async.algos.masked_stats import masked_mean

# verl-omni's algorithm.adv_mode values (DiffusionAlgoConfig).
ADV_MODES = ("continuous", "positive_only", "negative_only", "one_only", "binary")

# (flat steps k0, ramp per step, ceiling d_max): NVlabs' decay_type 0 / 1 / 2 under verl-omni's names, AWM's
# anchor (its authors' kl_ema_decay_type=linear, kl_ema_decay=0.3: algos.awm), and the delayed ramp compressed for
# short runs.
DECAY_SCHEDULES: dict[str, tuple[int, float, float]] = {
    "copy": (0, 0.0, 0.0),
    "linear_to_0_5": (0, 0.001, 0.5),
    "delayed_linear_to_0_999": (75, 0.0075, 0.999),
    "linear_to_0_3": (0, 0.001, 0.3),
    # delayed_linear_to_0_999 with time compressed 15-fold (k0 75 / 15, rate 0.0075 x 15): d_k = 0 for k < 5, then
    # min(0.1125 (k - 5), 0.999), 0.999 from step 14 on; over the CPU main job's 20 steps it copies for the first
    # quarter and holds the anchor from step 14, as the reference ramp does over 300 steps (flat 75, 0.999 at 208).
    "delayed_linear_to_0_999_x15": (5, 0.1125, 0.999),
}

# The rollout schedule's timesteps are sigma x this (diffusers' FlowMatchEulerDiscreteScheduler).
NUM_TRAIN_TIMESTEPS = 1000.0


def optimality_probability(
    advantages: torch.Tensor, *, adv_clip_max: float, adv_mode: str = "continuous"
) -> torch.Tensor:
    """``r = clip(1/2 + a / (2c), 0, 1)`` with ``a = clip(A, -c, c)`` reshaped by ``adv_mode``; ``[N]``.

    ``continuous``: ``a``; ``positive_only``: ``max(a, 0)``; ``negative_only``: ``min(a, 0)``; ``one_only``:
    ``[a > 0]`` (``r`` in {1/2, 1/2 + 1/(2c)}); ``binary``: ``sign(a)`` (``r`` in {1/2 - 1/(2c), 1/2, 1/2 + 1/(2c)}).
    NVlabs ``train_nft_sd3.py`` (``train.adv_mode``) and verl-omni ``DiffusionNFTLoss._advantage_to_reward_prob``.
    """
    if adv_mode not in ADV_MODES:
        raise ValueError(f"adv_mode={adv_mode!r}: use one of {', '.join(ADV_MODES)}")
    c = float(adv_clip_max)
    a = advantages.float().clamp(-c, c)
    if adv_mode == "positive_only":
        a = a.clamp(min=0.0)
    elif adv_mode == "negative_only":
        a = a.clamp(max=0.0)
    elif adv_mode == "one_only":
        a = (a > 0).float()
    elif adv_mode == "binary":
        a = torch.sign(a)
    return (0.5 + 0.5 * a / c).clamp(0.0, 1.0)


def forward_noised(x0: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``x_t = (1 - t) x0 + t eps`` with ``t = sigma`` per sample (``[B]``, broadcast over the other dims)."""
    t = sigma.to(x0.dtype).view(-1, *[1] * (x0.ndim - 1))
    return (1.0 - t) * x0 + t * noise


def train_steps(num_steps: int, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """The denoising steps one sample trains on: ``max(1, int(num_steps * fraction))`` of the rollout's
    ``num_steps`` steps, a random subset in random order from the sample's own ``generator`` (verl-omni's
    ``_select_train_timesteps`` draws a permutation per row; NVlabs trains the first ``fraction`` of a shuffled
    list)."""
    n = max(1, int(num_steps * float(fraction)))
    return torch.randperm(int(num_steps), generator=generator)[:n]


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x0: torch.Tensor,
    xt: torch.Tensor,
    sigma: torch.Tensor,
    reward_prob: torch.Tensor,
    mask: torch.Tensor,
    *,
    mix_beta: float,
    adv_clip_max: float,
    adaptive_weight_min: float,
    v_ref: torch.Tensor | None = None,
    ref_kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, metrics)`` of one training timestep (module docstring). ``v_theta, v_old, x0, xt`` ``[B, ...]``
    (fp32), ``sigma, reward_prob, mask`` ``[B]``. Metrics are verl-omni's names, detached 0-d tensors (read once,
    after the backward passes)."""
    beta = float(mix_beta)
    v_old = v_old.detach()
    dims = tuple(range(1, x0.ndim))
    t = sigma.to(x0.dtype).view(-1, *[1] * (x0.ndim - 1))
    r = reward_prob.detach().to(x0.dtype)
    v_pos = beta * v_theta + (1.0 - beta) * v_old
    v_neg = (1.0 + beta) * v_old - beta * v_theta
    x0_pos, x0_neg = xt - t * v_pos, xt - t * v_neg
    with torch.no_grad():  # the adaptive weights are constants of the step (fp64 mean, as the references)
        w_pos = (x0_pos.double() - x0.double()).abs().mean(dims, keepdim=True).clamp(min=adaptive_weight_min)
        w_neg = (x0_neg.double() - x0.double()).abs().mean(dims, keepdim=True).clamp(min=adaptive_weight_min)
    pos = ((x0_pos - x0) ** 2 / w_pos.to(x0.dtype)).mean(dims)
    neg = ((x0_neg - x0) ** 2 / w_neg.to(x0.dtype)).mean(dims)
    per_sample = (r * pos + (1.0 - r) * neg) * (float(adv_clip_max) / beta)
    policy_loss = masked_mean(per_sample, mask)
    loss = policy_loss
    metrics: dict[str, torch.Tensor] = {}
    if v_ref is not None and ref_kl_coef > 0:
        ref_kl = masked_mean(((v_theta - v_ref.detach()) ** 2).mean(dims), mask)
        loss = loss + float(ref_kl_coef) * ref_kl
        metrics["actor/ref_kl_loss"] = ref_kl.detach()
    with torch.no_grad():
        metrics.update(
            {
                "actor/policy_loss": policy_loss.detach(),
                "actor/positive_loss": masked_mean(pos, mask),
                "actor/negative_loss": masked_mean(neg, mask),
                "actor/old_deviate": masked_mean(((v_theta - v_old) ** 2).mean(dims), mask),
                "actor/reward_prob_mean": masked_mean(r, mask),
                "actor/total_loss": loss.detach(),
            }
        )
    return loss, metrics


def old_policy_decay(k: int, schedule: str, fixed: float | None = None) -> float:
    """``d_k``: ``fixed`` when given, else the schedule's ramp at ``k``, the feedback rounds behind the step's data
    (:func:`omni_async.algos.staleness.feedback_rounds`; the 1-based step number in lock-step modes)."""
    if fixed is not None:
        return float(fixed)
    if schedule not in DECAY_SCHEDULES:
        raise ValueError(f"old_policy_decay_schedule={schedule!r}: use one of {', '.join(DECAY_SCHEDULES)}")
    flat, rate, ceiling = DECAY_SCHEDULES[schedule]
    return 0.0 if k < flat else min((k - flat) * rate, ceiling)


def refreshes_after(step: int, interval: int) -> bool:
    """Whether the old policy is refreshed after training step ``step`` (1-based): every ``interval`` steps."""
    return step % int(interval) == 0


@torch.no_grad()
def ema_update_(old: Iterable[torch.Tensor], new: Iterable[torch.Tensor], decay: float) -> None:
    """``old <- decay * old + (1 - decay) * new`` in place, tensor by tensor (``decay = 0``: a copy)."""
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"old-policy decay must be in [0, 1], got {decay}")
    for o, n in zip(old, new, strict=True):
        if decay == 0.0:
            o.copy_(n)
        else:
            o.lerp_(n.to(o.dtype), 1.0 - decay)
