"""verl's rollout correction keys. Decoupled mode (``bypass_mode=false``): truncated IS weights and rejection masks
between pi_old (recomputed) and the rollout's log-probs, computed with verl's own helper and applied by the image and
text losses. Bypass mode (pi_old = pi_rollout): per loss call between the policy being trained and the rollout's, as
verl's ``compute_policy_loss_bypass_mode`` (text) and verl-omni's per-step ``diffusion_loss`` (images) compute them:
the rejection mask applied, the IS weights reported (``loss_type=ppo_clip``), verl's metric names. No Ray."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import SMALL_LORA
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_policy_loss_bypass_mode
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

from omni_async.algos.loss import BYPASS_CORRECTION_KEY, DUAL_CLIP_RATIO_C, flow_grpo_loss, grpo_token_loss
from omni_async.modality.image import ImageModality
from omni_async.modality.text import TextModality
from omni_async.trainer.actor_core import update_minibatch
from omni_async.trainer.config import ConfigError, compose, validate
from omni_async.trainer.step_ops import StepOps, minibatches
from omni_async.trainer.timer import Timer

DECOUPLED = ["algorithm.rollout_correction.bypass_mode=false"]
BYPASS_SPEC = {
    "rollout_is": "token",
    "rollout_is_threshold": 2.0,
    "rollout_is_batch_normalize": True,  # in bypass mode verl normalises the reported weights per loss call
    "rollout_rs": "token_k1",
    "rollout_rs_threshold": "0.6_1.5",
}
# bypass_mode=true given: lock-step's default is verl-omni's false (pi_old recomputed)
BYPASS = [
    "algorithm.rollout_correction.bypass_mode=true",
    *[f"algorithm.rollout_correction.{k}={v}" for k, v in BYPASS_SPEC.items()],
]


# The image config's keys here were written with LoRA (rank 8, alpha 16: this project's earlier default; verl's 0, a
# full fine-tune, ships to a rollout pool only with checkpoint_engine nccl).
def cfg(*overrides: str):
    return validate(compose(["data.train_files=x.jsonl", *SMALL_LORA, *overrides]))


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
        (BYPASS[:1] + ["algorithm.rollout_correction.rollout_rs=seq_mean_k1"], "rollout_rs_threshold", "0.5_2.0"),
        (
            ["algorithm.rollout_correction.rollout_is_batch_normalize=true"],
            "rollout_is_batch_normalize",
            "rollout_is=token",
        ),
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


# ---- bypass mode ------------------------------------------------------------------------------------------------
class FakePolicy:
    """A policy whose log-probs are one parameter ``theta`` (text: [B, T]; images: [B, W], one column per window
    step): the loss's gradient is the gradient with respect to the log-probs themselves."""

    device = "cpu"

    def __init__(self, theta: torch.Tensor):
        self.theta = torch.nn.Parameter(theta.clone())

    def log_probs(self, *_):  # text
        return self.theta * 1.0

    def conditioning_from(self, batch):  # images
        return None

    def step(self, cond, latents, j, prev_sample):
        return SimpleNamespace(log_prob=self.theta[:, j])

    def trainable_parameters(self):
        return [self.theta]

    def refresh_working_weights(self):
        pass


# pi_theta / pi_rollout per element: inside [0.6, 1.5] or not, above the IS threshold 2.0 or not.
RATIOS = torch.tensor([[1.0, 3.0, 0.5], [1.2, 0.9, 1.4], [2.5, 1.0, 0.3], [1.0, 1.0, 1.0]])
ROLLOUT = torch.log(torch.tensor([[0.5, 0.2, 0.4], [0.3, 0.6, 0.5], [0.2, 0.4, 0.7], [0.5, 0.5, 0.5]]))
ADV = torch.tensor([1.0, -0.5, 0.8, 2.0])
LOSS_MASK = torch.tensor([True, True, True, False])  # sample 3 failed: out of the loss


def test_bypass_mode_composes_and_the_batch_carries_the_settings_to_the_loss():
    o = ops(*BYPASS)
    b = batch(ROLLOUT, LOSS_MASK.tolist())
    b.batch["advantages"] = ADV
    o.recompute_old_log_probs(b, Timer())
    assert torch.equal(b.batch["old_log_probs"], ROLLOUT)  # pi_old = pi_rollout: nothing recomputed
    assert b.meta_info[BYPASS_CORRECTION_KEY] == BYPASS_SPEC
    assert "rollout_is_weights" not in b.batch.keys() and o.take_corr_metrics() == {}  # nothing on the driver
    assert all(mb.meta_info[BYPASS_CORRECTION_KEY] == BYPASS_SPEC for mb in minibatches(b, 1))
    plain = batch(ROLLOUT, LOSS_MASK.tolist())
    ops(*BYPASS[:1]).recompute_old_log_probs(plain, Timer())
    assert BYPASS_CORRECTION_KEY not in plain.meta_info  # bypass without rollout_is / rollout_rs: as before


def test_bypass_text_loss_is_verls_bypass_mode_loss_on_the_same_tensors():
    """The text loss with the settings equals verl's ``compute_policy_loss_bypass_mode`` (ppo_clip): the RS mask of
    pi_theta / pi_rollout applied, the IS weights not (the PPO ratio is that ratio); gradients and metrics too."""
    response_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
    theta = ROLLOUT + torch.log(RATIOS)
    policy = FakePolicy(theta)
    b = DataProto.from_dict(
        tensors={
            "prompt_ids": torch.zeros(4, 1, dtype=torch.long),
            "prompt_mask": torch.ones(4, 1, dtype=torch.long),
            "response_ids": torch.zeros(4, 3, dtype=torch.long),
            "response_mask": response_mask,
            "old_log_probs": ROLLOUT,
            "advantages": ADV,
            "loss_mask": LOSS_MASK,
        },
        meta_info={BYPASS_CORRECTION_KEY: BYPASS_SPEC},
    )
    actor_cfg = OmegaConf.create({"clip_ratio": 0.2, "kl_loss_coef": 0.0})
    ours = TextModality().backward(policy, b, LOSS_MASK, actor_cfg)

    theta_v = theta.clone().requires_grad_(True)
    # verl's engine counts batch_num_tokens on the loss mask before the loss call rejects anything
    # (FSDPEngine.forward_backward_batch, ppo_loss -> global_batch_info): a rejected token weighs 0 and stays in the
    # token-mean's denominator. (This test used {} here, which makes verl's agg_loss divide by the rejected-out mask,
    # the denominator our loss had then; verl's actor never runs the loss that way.)
    verl_cfg = OmegaConf.create(
        {
            "clip_ratio": 0.2,
            "clip_ratio_low": None,
            "clip_ratio_high": None,
            "clip_ratio_c": DUAL_CLIP_RATIO_C,
            "global_batch_info": {"dp_size": 1, "batch_num_tokens": int((response_mask * LOSS_MASK[:, None]).sum())},
            "policy_loss": {"rollout_correction": {**BYPASS_SPEC, "loss_type": "ppo_clip"}},
        }
    )
    loss, verl_metrics = compute_policy_loss_bypass_mode(
        old_log_prob=ROLLOUT,
        log_prob=theta_v,
        advantages=ADV[:, None].expand(4, 3),
        response_mask=response_mask * LOSS_MASK[:, None],
        loss_agg_mode="token-mean",
        config=verl_cfg,
    )
    loss.backward()
    assert ours["actor/pg_loss"] == [pytest.approx(loss.item(), abs=1e-7)]
    torch.testing.assert_close(policy.theta.grad, theta_v.grad)
    assert policy.theta.grad[0, 1] == 0 and policy.theta.grad[0, 0] != 0  # ratio 3.0: rejected, not truncated
    # the reference formula: sum over the kept tokens of the clipped term / the 8 tokens of the loss mask
    kept = ((RATIOS >= 0.6) & (RATIOS <= 1.5)) & (response_mask * LOSS_MASK[:, None]).bool()
    a = ADV[:, None].expand(4, 3)
    clipped = torch.maximum(-a * RATIOS, -a * RATIOS.clamp(0.8, 1.2))
    assert ours["actor/pg_loss"] == [pytest.approx(float((clipped * kept).sum() / 8), abs=1e-6)]
    corr = {k: v for k, v in verl_metrics.items() if k.startswith("rollout_corr/")}
    assert {"rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction"} <= set(corr)
    for k, v in corr.items():  # verl's actor reports its loss metrics as actor/<name>
        assert ours[f"actor/{k}"] == [pytest.approx(float(v))], k


def test_bypass_image_loss_applies_each_steps_rs_mask_and_reports_verls_metrics_per_step():
    """Per SDE-window step, as verl-omni's ``diffusion_loss`` in bypass mode: verl's helper on the step's
    ``[B, 1]`` log-probs (current vs rollout), its rejection mask a 0 weight on the step's loss (``_apply_bypass_rc``
    folds it into ``rollout_is_weights``; ``FlowGRPOLoss`` takes ``torch.mean`` over every sample); through the
    actor's optimizer step, whose metrics carry verl's names."""
    theta = ROLLOUT + torch.log(RATIOS)
    policy = FakePolicy(theta)
    tensors = {
        "window_latents": torch.zeros(4, 4, 1),  # 3 window steps
        "old_log_probs": ROLLOUT,
        "advantages": ADV,
        "loss_mask": LOSS_MASK,
    }
    b = DataProto.from_dict(tensors=tensors, meta_info={"window_start": 0, BYPASS_CORRECTION_KEY: BYPASS_SPEC})
    actor_cfg = OmegaConf.create(
        {
            "diffusion_loss": {"clip_ratio": 0.2},
            "kl_loss_coef": 0.0,
            "grad_clip": 1e9,
            "ppo_micro_batch_size_per_gpu": 4,
        }
    )
    optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=0.0)  # the step leaves theta.grad to read
    ours = update_minibatch(ImageModality(), policy, optimizer, b, actor_cfg)

    theta_v = theta.clone().requires_grad_(True)
    want: dict[str, list[float]] = {}
    for j in range(3):
        _, _, m = compute_rollout_correction_and_rejection_mask(
            theta_v[:, j, None].detach(), ROLLOUT[:, j, None], LOSS_MASK[:, None].float(), **BYPASS_SPEC
        )
        for k, v in m.items():
            want.setdefault(f"actor/{k}", []).append(v)
    # the reference formula, per window step j: sum_i m_i k_ij max(-A_i r_ij, -A_i clip(r_ij)) / sum_i m_i, with
    # k_ij = [0.6 <= r_ij <= 1.5] (token_k1 on pi_theta / pi_rollout), m the loss mask (3 samples); averaged over j
    ratio = torch.exp(theta_v - ROLLOUT)
    keep = ((RATIOS >= 0.6) & (RATIOS <= 1.5)).float() * LOSS_MASK[:, None]
    a = ADV[:, None]
    per = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
    ((per * keep).sum(0) / LOSS_MASK.sum()).mean().backward()
    torch.testing.assert_close(policy.theta.grad, theta_v.grad)
    assert policy.theta.grad[2, 0] == 0 and policy.theta.grad[0, 0] != 0  # ratio 2.5 at step 0: rejected
    assert {"actor/rollout_corr/rollout_is_mean", "actor/rollout_corr/rollout_rs_masked_fraction"} <= set(ours)
    for k, v in want.items():  # the step's metric: the mean over the window's loss calls
        assert ours[k] == pytest.approx(float(np.mean(v))), k


class RowPolicy(FakePolicy):
    """:class:`FakePolicy` for micro-batches: a batch row ``i`` (its ``row`` tensor, text: ``prompt_ids[:, 0]``)
    reads ``theta[i]``."""

    def log_probs(self, prompt_ids, *_):
        return self.theta[prompt_ids[:, 0]]

    def conditioning_from(self, batch):
        return batch["row"]

    def step(self, cond, latents, j, prev_sample):
        return SimpleNamespace(log_prob=self.theta[cond, j])


def test_decoupled_image_loss_weighs_rejected_steps_zero_over_the_whole_batch():
    """Decoupled mode, as verl-omni's ``apply_rollout_correction_to_diffusion_batch``: the rejected steps' flag folded
    into the IS weight (``w = min(pi_old / pi_rollout, C) x keep``) and the step's loss a mean over every sample in
    the loss, so a rejected step counts in the denominator; through the actor's optimizer step in 2 micro-batches."""
    old = torch.log(torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]))
    theta = old + torch.log(RATIOS)
    policy = RowPolicy(theta)
    is_w = torch.tensor([[1.0, 2.0, 0.5], [1.5, 1.0, 0.7], [2.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    rs = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0], [0.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    tensors = {
        "row": torch.arange(4),
        "window_latents": torch.zeros(4, 4, 1),
        "old_log_probs": old,
        "advantages": ADV,
        "loss_mask": LOSS_MASK,
        "rollout_is_weights": is_w,
        "rollout_rs_mask": rs,
    }
    b = DataProto.from_dict(tensors=tensors, meta_info={"window_start": 0})
    actor_cfg = OmegaConf.create(
        {
            "diffusion_loss": {"clip_ratio": 0.2},
            "kl_loss_coef": 0.0,
            "grad_clip": 1e9,
            "ppo_micro_batch_size_per_gpu": 2,
        }
    )
    optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=0.0)
    ours = update_minibatch(ImageModality(), policy, optimizer, b, actor_cfg)

    theta_v = theta.clone().requires_grad_(True)
    ratio = torch.exp(theta_v - old)
    a = ADV[:, None]
    per = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2)) * is_w * rs * LOSS_MASK[:, None]
    (per.sum(0) / 3).mean().backward()  # 3 samples in the loss, rejected ones included
    torch.testing.assert_close(policy.theta.grad, theta_v.grad)
    assert policy.theta.grad[0, 1] == 0 and policy.theta.grad[2, 0] == 0  # rejected: no gradient
    # sample 1's step 2 is rejected: sample 0's step 2 keeps its 1/3 share of the step (a mean over the kept
    # samples would give it 1/2): d/dtheta of -A r w / 3 / 3 steps
    assert policy.theta.grad[0, 2].item() == pytest.approx(-1.0 * 0.5 * 0.5 / 9, abs=1e-6)
    assert "actor/pg_loss" in ours


def test_decoupled_text_rejection_leaves_the_token_mean_and_its_denominator_over_micro_batches():
    """Decoupled mode, as verl: the driver takes rejected tokens out of ``response_mask`` before the update
    (``compute_rollout_correction_and_add_to_batch``), and the engine's ``batch_num_tokens`` counts that mask, so
    the mini-batch's loss is ``sum_kept w l / n_kept`` whatever the micro-batching (here 2 + 2 samples)."""
    response_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
    rs = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    is_w = torch.tensor([[1.0, 2.0, 0.5], [1.5, 1.0, 0.7], [2.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    old = torch.zeros(4, 3)
    theta = old + torch.log(RATIOS)
    policy = RowPolicy(theta)
    tensors = {
        "prompt_ids": torch.arange(4)[:, None],
        "prompt_mask": torch.ones(4, 1, dtype=torch.long),
        "response_ids": torch.zeros(4, 3, dtype=torch.long),
        "response_mask": response_mask,
        "old_log_probs": old,
        "advantages": ADV,
        "loss_mask": LOSS_MASK,
        "rollout_is_weights": is_w,
        "rollout_rs_mask": rs,
    }
    b = DataProto.from_dict(tensors=tensors)
    actor_cfg = OmegaConf.create(
        {"clip_ratio": 0.2, "kl_loss_coef": 0.0, "grad_clip": 1e9, "ppo_micro_batch_size_per_gpu": 2}
    )
    assert TextModality().loss_units(b) == 5  # 8 response tokens in the loss, 3 of them rejected
    optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=0.0)
    update_minibatch(TextModality(), policy, optimizer, b, actor_cfg)

    theta_v = theta.clone().requires_grad_(True)
    ratio = torch.exp(theta_v - old)
    a = ADV[:, None].expand(4, 3)
    clipped = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
    per = torch.where(a < 0, torch.minimum(clipped, -a * DUAL_CLIP_RATIO_C), clipped)
    kept = response_mask * LOSS_MASK[:, None] * rs
    ((per * is_w * kept).sum() / kept.sum()).backward()
    torch.testing.assert_close(policy.theta.grad, theta_v.grad)


# ---- rollout_is_batch_normalize (verl's rule, decoupled mode) ---------------------------------------------------
def test_batch_normalize_divides_the_truncated_token_weights_by_their_mean_over_the_kept_steps():
    """verl's ``rollout_is_batch_normalize`` at ``rollout_is=token``: ``w = min(pi_old / pi_rollout, C)`` on the
    valid elements (0 elsewhere), then ``w / mean_valid(w)``: the mean over the batch's valid elements is 1; a sample
    out of the loss has weight 0 and stays out of the mean."""
    o = ops(
        *DECOUPLED,
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_batch_normalize=true",
    )
    ratios = torch.tensor([[1.0, 3.0], [0.25, 1.2], [5.0, 5.0]])  # the last sample is out of the loss
    b = batch(torch.log(ratios), [True, True, False])
    o.rollout_correction(b, torch.zeros(3, 2))
    truncated = [1.0, 2.0, 0.25, 1.2]  # min(ratio, 2) over the 4 kept window steps
    mean = sum(truncated) / 4
    want = torch.tensor([[1.0, 2.0], [0.25, 1.2], [0.0, 0.0]]) / mean
    torch.testing.assert_close(b.batch["rollout_is_weights"], want)
    assert float(b.batch["rollout_is_weights"][:2].mean()) == pytest.approx(1.0)
    assert o.take_corr_metrics()["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(mean)


def test_batch_normalize_at_sequence_level_averages_one_weight_per_sample():
    """``rollout_is=sequence``: each sample's weight ``min(prod_t ratio_t, C)``, normalised by the mean of the
    samples' weights (not of the elements): sample weights 3 and 0.25 -> mean 1.625."""
    o = ops(
        *DECOUPLED,
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_threshold=5.0",
        "algorithm.rollout_correction.rollout_is_batch_normalize=true",
    )
    b = batch(torch.log(torch.tensor([[1.5, 2.0], [0.5, 0.5]])), [True, True])
    o.rollout_correction(b, torch.zeros(2, 2))
    torch.testing.assert_close(b.batch["rollout_is_weights"], torch.tensor([[3.0, 3.0], [0.25, 0.25]]) / 1.625)


# ---- bypass_mode's default -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "bypass"),
    [
        ([], False),  # lock-step: verl's and verl-omni's default, pi_old recomputed
        (["reward.streaming=false"], False),
        (["async_reward.one_step_off_policy=true"], True),  # verl's one_step_off trainer's default
        (["async_reward.update_pipeline=true", "algorithm.global_std=false"], True),
        (["actor_rollout_ref.rollout.nnodes=1", "async_reward.fully_async=true"], True),  # verl's fully_async's
        (
            [
                "actor_rollout_ref.rollout.nnodes=1",
                "async_reward.fully_async=true",
                *DECOUPLED,
                "algorithm.rollout_correction.rollout_is=token",
            ],
            False,  # given: kept (verl's decoupled mode in fully async)
        ),
        (
            [
                "actor_rollout_ref.rollout.nnodes=1",
                "data.train_batch_size=4",
                "async_training.trigger_parameter_sync_step=4",  # 4 updates of 2 prompts: a sync every 2 steps
            ],
            True,
        ),
        (["algorithm.rollout_correction.bypass_mode=true"], True),  # given: kept
    ],
)
def test_bypass_mode_defaults_to_the_modes_as_verls_configs(overrides, bypass):
    assert cfg(*overrides).algorithm.rollout_correction.bypass_mode is bypass
