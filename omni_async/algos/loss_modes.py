"""The diffusion loss modes: verl-omni's ``actor_rollout_ref.actor.diffusion_loss.loss_mode``, one registry.

A loss mode says what the rollout must carry for it (its data path) and under which
``actor_rollout_ref.model.algorithm`` it runs; the image modality dispatches on it (``ImageModality.backward``) and
the config check refuses a mode that is listed here but not built, naming the built loss to use instead.

- ``sde_window``: the rollout stores the SDE window's latents and log-probs (FlowGRPO and the policy-gradient losses
  on the reverse process: GRPO-Guard, Flow-DPPO, DanceGRPO; DiffusionOPD's ``distill_kl``, which also reads the
  frozen teacher's velocity per window step: ``LossMode.teacher``); the loss runs window step by window step.
- ``final_latents``: the rollout stores only the clean final latents (DiffusionNFT, AWM, Diffusion-DPO); the loss
  noises them again on the forward process. DiffusionNFT samples with its lagging ``old`` policy, AWM with the
  current one (``algos.awm``).

A window loss with ``old_means`` (GRPO-Guard, Flow-DPPO) also reads each window step's Gaussian mean under pi_old:
in bypass mode the rollout stores it beside the step's log-prob (``ImageResult.window_means``, batch key
``old_means``); with ``algorithm.rollout_correction.bypass_mode=false`` the log-prob recompute returns it too.

The image modality dispatches on the entry (``ImageModality.backward``): a window loss names its per-step loss
(``window_loss``, one signature: ``algos.window_losses``), which ``_window_backward`` calls on each window step; a
final-latent loss names its backward (``backward``: ``nft`` -> ``_nft_backward``, ``awm`` -> ``_awm_backward``,
each a ``_forward_steps`` loop; ``dpo`` -> ``_dpo_backward``, one forward per pair). To add a loss: its pure math
in ``algos/`` and an entry here with ``built=True`` (a window loss: an adapter in ``algos.window_losses``; a
final-latent loss: its backward in the modality, and the batch it needs as flags: ``optimality_prob``,
``preference_pairs``, ``stratified_steps``, ``matching_log_prob``). The trainer and the modality ask the entry, never
the loss's name (``tests/structure/test_decided_once.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_async.algos.window_losses import (
    WindowLoss,
    dance_grpo_window,
    distill_kl_window,
    flow_dppo_window,
    flow_grpo_window,
    grpo_guard_window,
)


@dataclass(frozen=True)
class LossMode:
    name: str
    data_path: str  # sde_window | final_latents
    algorithm: str  # the actor_rollout_ref.model.algorithm it runs under (verl-omni's pairing)
    built: bool = True
    old_means: bool = False  # the loss reads pi_old's window-step means (batch key ``old_means``)
    # the batch's advantages clipped to +-diffusion_loss.adv_clip_max when it is built (verl-omni's FlowGRPOLoss and
    # GRPOGuardLoss clip them; AWM clips, then scales); false: DiffusionNFT (its map to r clips), Flow-DPPO
    # (verl-omni's FlowDPPOLoss takes them as they are)
    clips_advantages: bool = True
    instead: str = ""  # not built: the built loss mode that trains on the same data, named by the refusal
    # sde_window: the per-window-step loss (algos.window_losses); final_latents: None
    window_loss: WindowLoss | None = None
    # which ImageModality backward runs it: window (the SDE window, window_loss per step) | nft | awm ("": not built)
    backward: str = "window"
    # the loss reads the frozen teacher's velocity at each window step (DiffusionOPD: batch key ``teacher_velocity``,
    # scored beside the reward by ``reward.teacher``; distillation.enabled must be on with it and only with it)
    teacher: bool = False
    # What the trainer's batch carries for a final-latent loss, asked by StepOps instead of the loss's name:
    # DiffusionNFT's optimality probability r = map(advantage) (batch key ``reward_prob``, algos.diffusion_nft)
    optimality_prob: bool = False
    # Diffusion-DPO: each group's (chosen, rejected) pair, adjacent rows (StepOps.preference_batch, algos.dpo)
    preference_pairs: bool = False
    # AWM: the training steps drawn stratified once per mini-batch (algos.awm.draw_train_steps); otherwise
    # DiffusionNFT's random algorithm.timestep_fraction of the steps per sample (algos.diffusion_nft.train_steps)
    stratified_steps: bool = False
    # AWM: its log-prob is the matching log-likelihood at the batch's training steps (algos.awm.matching_log_prob),
    # recomputed as pi_old with rollout_correction.bypass_mode=false; a window loss's is the SDE step's
    matching_log_prob: bool = False

    @property
    def final_latents(self) -> bool:
        """Trained from each sample's clean latents (the forward process: DiffusionNFT, AWM, DPO), not from its SDE
        window's log-probs."""
        return self.data_path == FINAL_LATENTS


SDE_WINDOW, FINAL_LATENTS = "sde_window", "final_latents"
PLANNED_ISSUE = "issue 38"  # where the modes not built are tracked

LOSS_MODES: dict[str, LossMode] = {
    m.name: m
    for m in (
        LossMode("flow_grpo", SDE_WINDOW, "flow_grpo", window_loss=flow_grpo_window),
        LossMode(
            "diffusion_nft",
            FINAL_LATENTS,
            "diffusion_nft",
            clips_advantages=False,
            backward="nft",
            optimality_prob=True,
        ),
        # verl-omni's other modes (issue 38), and AWM (which verl-omni names but has no loss for).
        LossMode("grpo_guard", SDE_WINDOW, "flow_grpo", old_means=True, window_loss=grpo_guard_window),
        LossMode(
            "flow_dppo", SDE_WINDOW, "flow_grpo", old_means=True, clips_advantages=False, window_loss=flow_dppo_window
        ),
        LossMode("awm", FINAL_LATENTS, "awm", backward="awm", stratified_steps=True, matching_log_prob=True),
        # DanceGRPO (algos.dance_grpo): verl-omni's FlowGRPO loss and advantage on DanceGRPO's SDE step
        # (rollout.algo.sde_type=dance_sde, which its recipe sets).
        LossMode("dance_grpo", SDE_WINDOW, "dance_grpo", window_loss=dance_grpo_window),
        # DiffusionOPD (algos.distill): the student's SDE window pulled toward a frozen teacher's step means, under
        # model.algorithm=flow_grpo as verl-omni's recipe; the advantage is computed (the reward is monitored) unused.
        LossMode("distill_kl", SDE_WINDOW, "flow_grpo", teacher=True, window_loss=distill_kl_window),
        # Diffusion-DPO (algos.dpo): each group's best and worst final latents as a (chosen, rejected) pair, or an
        # offline dataset's pairs (algorithm.sample_source=offline); StepOps.preference_batch lays the pairs out.
        LossMode("dpo", FINAL_LATENTS, "dpo", backward="dpo", preference_pairs=True),
    )
}


# verl-omni's on-policy distillation loss that has no producer (distill_fm_mse toward the teacher's flow predictions:
# verl-omni itself refuses it on its policy-gradient path, as its teacher returns transition means only). Refused by
# the config check naming distill_kl; not in LOSS_MODES.
DISTILL_LOSS_MODES = ("distill_fm_mse",)

# verl-omni's diffusion algorithms (actor_rollout_ref.model.algorithm) not built, -> the built one to use instead.
PLANNED_ALGORITHMS = {m.algorithm: m.instead for m in LOSS_MODES.values() if not m.built}

# Algorithms that change only the rollout's sampling, -> the algorithm whose losses they train with. MixGRPO places
# one SDE window per training step by a schedule (``algos.mix_grpo``, ``agent_loop.draws.Draws.window``); verl-omni's
# recipe pins ``diffusion_loss.loss_mode=flow_grpo``.
SAMPLING_ALGORITHMS = {"mix_grpo": "flow_grpo"}


def loss_algorithm(algorithm: str) -> str:
    """The algorithm whose loss modes ``actor_rollout_ref.model.algorithm=algorithm`` trains with (itself, or the
    base algorithm of a sampling-only one such as ``mix_grpo``)."""
    return SAMPLING_ALGORITHMS.get(algorithm, algorithm)


def loss_mode(name: str) -> LossMode:
    """The registered loss mode ``name`` (built or not); an unknown name raises ``ValueError`` naming the list."""
    if name not in LOSS_MODES:
        raise ValueError(f"unknown diffusion loss_mode {name!r}; known: {', '.join(LOSS_MODES)}")
    return LOSS_MODES[name]
