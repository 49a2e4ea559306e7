"""DiffusionNFT through the trainer: verl-omni's keys (its recipe's overrides compose and validate here, the unsupported
ones are refused naming the fix), and real Ray runs on tiny SD3 in each mode and layout: the rollout samples with the
old policy (sent to rollout replicas in place of the live weights), samples carry no log-probs, every group is
trained once, and the old policy is refreshed by its schedule."""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL_IMAGE_TRAINER, SMALL_LORA, drawn_latents, record_trained_uids, switch_mode

from omni_async.modality import modality_of
from omni_async.trainer.config import ConfigError, compose, validate
from omni_async.trainer.mode import PIPELINE

# verl-omni's examples/diffusionnft_trainer/qwen_image/run_qwen_image_ocr_lora.sh, its DiffusionNFT overrides as
# written there (model, engine, sizes and reward are the tiny stand-ins of SMALL_IMAGE_TRAINER).
NFT = [
    "actor_rollout_ref.model.algorithm=diffusion_nft",
    "actor_rollout_ref.model.model_type=diffusion_nft_model",
    'actor_rollout_ref.model.policy_state_adapters=["default","old"]',
    "actor_rollout_ref.actor.diffusion_loss.loss_mode=diffusion_nft",
    "actor_rollout_ref.actor.diffusion_loss.clip_ratio=1e-5",
    "actor_rollout_ref.actor.diffusion_loss.mix_beta=0.1",
    "actor_rollout_ref.actor.diffusion_loss.ref_kl_coef=0.0001",
    "actor_rollout_ref.actor.diffusion_loss.adv_clip_max=5.0",
    "actor_rollout_ref.rollout.calculate_log_probs=False",
    "actor_rollout_ref.rollout.rollout_adapter=old",
    "algorithm.trainer_type=direct_preference",
    "algorithm.sample_source=online",
    "algorithm.timestep_fraction=1.0",
    "algorithm.old_policy_decay_schedule=delayed_linear_to_0_999",
    "algorithm.old_policy_update_interval=2",
    "algorithm.adv_mode=continuous",
]


# The image config's keys here were written with LoRA (rank 8, alpha 16: this project's earlier default; verl's 0 is a
# full fine-tune, which keeps no frozen reference for ref_kl_coef / kl_loss_coef); a test of that passes lora_rank=0.
def valid(*overrides: str):
    return validate(compose(["data.train_files=x.jsonl", *SMALL_LORA, *overrides]))


# ---- keys (no Ray) ---------------------------------------------------------------------------------------------
def test_verl_omni_recipe_composes_and_loss_mode_follows_the_algorithm():
    cfg = valid(*NFT)
    modality = modality_of(cfg)
    assert modality.loss_mode == "diffusion_nft" and not modality.uses_window  # ODE rollout: no SDE window drawn
    assert modality.sampling_config(cfg).clean_latents
    # loss_mode left out: it follows actor_rollout_ref.model.algorithm (verl-omni's interpolation)
    assert valid(*[o for o in NFT if ".loss_mode=" not in o]).actor_rollout_ref.actor.diffusion_loss.loss_mode == (
        "diffusion_nft"
    )
    flow = valid()
    assert flow.actor_rollout_ref.actor.diffusion_loss.loss_mode == "flow_grpo" and modality_of(flow).uses_window
    assert flow.actor_rollout_ref.actor.diffusion_loss.clip_ratio == 1e-4  # verl-omni's defaults
    assert flow.actor_rollout_ref.actor.diffusion_loss.mix_beta == 0.5


def test_compressed_delayed_ramp_is_accepted_and_named_in_the_refusal():
    cfg = valid(*NFT, "algorithm.old_policy_decay_schedule=delayed_linear_to_0_999_x15")
    assert cfg.algorithm.old_policy_decay_schedule == "delayed_linear_to_0_999_x15"
    with pytest.raises(ConfigError, match="delayed_linear_to_0_999_x15"):
        valid(*NFT, "algorithm.old_policy_decay_schedule=delayed_linear_to_0_999_x10")


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        (["actor_rollout_ref.actor.clip_ratio=0.2"], "actor_rollout_ref.actor.clip_ratio", "diffusion_loss.clip_ratio"),
        (["algorithm.adv_clip_max=3"], "algorithm.adv_clip_max", "diffusion_loss.adv_clip_max=3"),
        (["actor_rollout_ref.actor.diffusion_loss.loss_mode=ppo"], "loss_mode", "flow_grpo, diffusion_nft"),
        (["actor_rollout_ref.model.algorithm=mix_grpo"], "diffusion_loss.loss_mode", "loss_mode=flow_grpo"),
        (
            [
                "actor_rollout_ref.rollout.algo.sde_type=cps",
                "actor_rollout_ref.actor.diffusion_loss.loss_mode=grpo_guard",
            ],
            "rollout.algo.sde_type",
            "sde_type=sde",
        ),
        (
            [
                "actor_rollout_ref.rollout.algo.sde_type=cps",
                "actor_rollout_ref.actor.diffusion_loss.loss_mode=flow_dppo",
            ],
            "rollout.algo.sde_type",
            "sde_type=sde",
        ),
        (
            [
                "actor_rollout_ref.model.algorithm=mix_grpo",
                "actor_rollout_ref.actor.diffusion_loss.loss_mode=flow_grpo",
                "actor_rollout_ref.rollout.algo.sample_strategy=sliding",
            ],
            "algo.sample_strategy",
            "random, progressive",
        ),
        (
            [
                "actor_rollout_ref.model.algorithm=mix_grpo",
                "actor_rollout_ref.actor.diffusion_loss.loss_mode=flow_grpo",
                "actor_rollout_ref.rollout.algo.iters_per_group=0",
            ],
            "algo.iters_per_group",
            ">= 1",
        ),
        (
            [
                "actor_rollout_ref.model.algorithm=mix_grpo",
                "actor_rollout_ref.actor.diffusion_loss.loss_mode=diffusion_nft",
            ],
            "loss_mode",
            "model.algorithm=diffusion_nft",
        ),
        (
            ["actor_rollout_ref.model.algorithm=ppo"],
            "model.algorithm",
            "awm, dance_grpo, diffusion_nft, dpo, flow_grpo",
        ),
        (["actor_rollout_ref.actor.diffusion_loss.loss_mode=diffusion_nft"], "loss_mode", "model.algorithm=diffusion"),
        ([*NFT, "actor_rollout_ref.rollout.rollout_adapter=default"], "rollout.rollout_adapter", "rollout_adapter=old"),
        ([*NFT, "actor_rollout_ref.model.model_type=diffusion_model"], "model.model_type", "diffusion_nft_model"),
        ([*NFT, "actor_rollout_ref.model.policy_state_adapters=[default]"], "policy_state_adapters", '"old"'),
        ([*NFT, "algorithm.trainer_type=policy_gradient"], "algorithm.trainer_type", "direct_preference"),
        ([*NFT, "algorithm.sample_source=offline"], "algorithm.sample_source", "online"),
        ([*NFT, "actor_rollout_ref.rollout.calculate_log_probs=true"], "calculate_log_probs", "false"),
        (["actor_rollout_ref.rollout.calculate_log_probs=false"], "calculate_log_probs", "true"),
        ([*NFT, "actor_rollout_ref.actor.kl_loss_coef=0.01"], "kl_loss_coef", "ref_kl_coef=0.01"),
        ([*NFT, "algorithm.rollout_correction.rollout_is=token"], "rollout_is", "drop"),
        ([*NFT, "algorithm.drop_zero_adv_samples=true"], "drop_zero_adv_samples", "false"),
        ([*NFT, "algorithm.adv_mode=all"], "algorithm.adv_mode", "positive_only"),
        ([*NFT, "algorithm.old_policy_decay_schedule=cosine"], "old_policy_decay_schedule", "linear_to_0_5"),
        ([*NFT, "algorithm.old_policy_decay=1.5"], "algorithm.old_policy_decay", "null"),
        ([*NFT, "algorithm.old_policy_update_interval=0"], "old_policy_update_interval", "verl-omni"),
        ([*NFT, "algorithm.timestep_fraction=0"], "algorithm.timestep_fraction", "1.0"),
        ([*NFT, "actor_rollout_ref.actor.diffusion_loss.mix_beta=0"], "mix_beta", "README"),
        ([*NFT, "actor_rollout_ref.model.lora_rank=0"], "ref_kl_coef", "lora_rank=8"),
        (
            [
                *NFT,
                "actor_rollout_ref.model.lora_rank=0",
                "actor_rollout_ref.actor.diffusion_loss.ref_kl_coef=0",
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.rollout.agent.num_workers=2",
                "data.train_batch_size=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            ],
            "model.lora_rank",
            "one actor rank",
        ),  # fmt: skip
        (
            # NFT's reference is one call per actor micro-batch (only an SDE-window loss splits it)
            [
                *NFT,
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            ],
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
            "ppo_micro_batch_size_per_gpu",
        ),
    ],
)
def test_what_does_not_fit_is_refused_naming_key_and_fix(overrides, key, fix):
    with pytest.raises(ConfigError) as err:
        valid(*overrides)
    assert key in str(err.value) and fix in str(err.value), str(err.value)


def test_text_keeps_verls_clip_ratio():
    cfg = validate(compose(["data.train_files=x.jsonl"], config_name="grpo_text_trainer"))
    assert cfg.actor_rollout_ref.actor.clip_ratio == 0.2
    with pytest.raises(ConfigError, match="actor.clip_ratio=0.2"):
        validate(compose(["data.train_files=x.jsonl", "actor_rollout_ref.actor.clip_ratio=null"], "grpo_text_trainer"))


# ---- runs (real Ray, tiny SD3) -----------------------------------------------------------------------------------
RUN = [
    *NFT,
    "actor_rollout_ref.actor.optim.lr=5e-2",  # moves the live weights far from the old ones in one step
    "actor_rollout_ref.actor.diffusion_loss.ref_kl_coef=0",
    "trainer.log_image_freq=-1",
    "trainer.log_timeline_freq=-1",
]
POOL = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1"]
# One trainer per layout walks its modes (name, ``switch_mode`` arguments, steps): each way the rollout reads the old
# policy. Hybrid: built for the pipeline, so its worker generates from a snapshot of the old adapter taken at each
# sync (any mode that overlaps update and generation sets the snapshot up, one-step-off alike), which the sync mode
# it switches to goes on reading. (A hybrid worker built for a sync mode reads the old adapter in place: that branch
# is test_full_finetune_old_copy_samples_and_ships' hybrid case, the LoRA ``old_policy()`` it enters
# tests/models/test_nft_policy.py's.) Disaggregated: the old weights shipped to a rollout pool, one-step-off then
# fully async (the split layout ships them through the same ``get_weights`` call: the full fine-tune test's split
# case). One-step-off runs 3 steps: its first draw made after a trained version is step 3's.
LAYOUTS = {
    "hybrid": (
        ["reward.streaming=true", *PIPELINE],
        [("stream_pipeline", {}, 2), ("sync", {"streaming": False, "update_pipeline": False}, 2)],
    ),
    "disaggregated": (
        [*POOL, "async_reward.one_step_off_policy=true", "async_training.staleness_threshold=1"],
        [("one_step_off", {}, 3), ("fully_async", {"one_step_off_policy": False, "fully_async": True}, 2)],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trains_in_every_mode_sampling_with_the_old_policy(trainers, layout, tmp_path):
    """``old_policy_decay=1``: the old policy never moves from the start (the base model), while lr 5e-2 moves the
    live weights far. Every sample of every step must then be the base model's, in every mode and layout: the
    rollout reads the old policy (hybrid: the old adapter's snapshot; disaggregated: the old weights are what is
    shipped). Samples carry clean latents and no log-probs; every drawn group is trained once across the switches.
    The hybrid trainer's sync steps also walk the refresh schedule (:func:`old_policy_follows_the_schedule`)."""
    build, modes = LAYOUTS[layout]
    trainer = trainers(*RUN, *build, "algorithm.old_policy_decay=1.0", "algorithm.old_policy_update_interval=1")
    trained = record_trained_uids(trainer.ops)
    steps, later, step = [], [], 0
    for name, switch, count in modes:
        if switch:
            switch_mode(trainer, **switch)
        if name == "sync":
            steps += old_policy_follows_the_schedule(trainer, step, tmp_path / "ckpt")
        else:  # the old policy refreshed at decay 1 after every step: it stays where it started
            steps += [trainer.train_step(s) for s in range(step, step + count)]
            assert all(m["old_policy/updated"] == 1.0 and m["old_policy/moved_l2"] == 0.0 for m, _ in steps[-count:])
            # trained late, the ramp is read at the rounds of feedback behind the step's data, not at the step count
            rounds = [m["old_policy/feedback_rounds"] for m, _ in steps[-count:]]
            assert rounds == [1 + max(s.version for s in samples) for _, samples in steps[-count:]]
            if name == "one_step_off":  # steps 1 and 2 train version 0's draws, step 3 version 1's
                assert rounds == [1, 1, 2]
        step += count
        drawn = [s for _, samples in steps[-count:] for s in samples if s.version >= 1]  # after the weights moved
        assert drawn, name
        later += drawn
    for metrics, samples in steps:
        assert all(s.result.log_probs.numel() == 0 and s.result.window_latents.numel() == 0 for s in samples)
        assert all(s.result.latents_clean is not None for s in samples)
        assert metrics["actor/policy_loss"] > 0 and "actor/pg_loss" not in metrics
    got = torch.stack([s.result.latents_clean for s in later])
    assert (got - drawn_latents(later)).abs().max() < 1e-4
    if layout != "hybrid":  # (the hybrid trainer checkpointed before its old policy's first move)
        trainer.placement.actor_wg.save_checkpoint(str(tmp_path / "ckpt"))
    # The live weights did move, far enough that a rollout reading them would have drawn other samples; the
    # checkpoint holds both, the old ones still the start's.
    state = torch.load(tmp_path / "ckpt" / "actor.pt", weights_only=True)
    assert (got - drawn_latents(later, state["weights"])).abs().max() > 1e-2
    assert max(float(state["old_weights"][k].abs().max()) for k in state["old_weights"] if "lora_B" in k) == 0.0
    uids = [s.uid for _, samples in steps for s in samples]
    assert sorted(set(trained)) == sorted(set(uids)) and len(trained) == len(uids)  # each sample trained once


def old_policy_follows_the_schedule(trainer, step: int, ckpt) -> list:
    """Two steps from ``step`` (an even one, the old policy fixed at the start until then) with ``linear_to_0_5``
    every 2 steps instead of the fixed decay 1 (``algorithm.*`` is read at each refresh): no refresh after the
    first, a refresh after the second with decay 0.001 x its 1-based step number that moves the old weights by
    (1 - decay) of their gap to the live ones, nonzero since the live weights moved while the old ones stayed at the
    start. The trainer is checkpointed to ``ckpt`` between the two (the old policy still the start's). Both steps'
    samples are drawn before that refresh (sync: a draw after the previous step's sync), by the start's old policy;
    returns both steps' ``(metrics, samples)``. (A test of its own, with a trainer of its own, until 2026-11-26.)"""
    algo = trainer.ops.cfg.algorithm
    algo.old_policy_decay, algo.old_policy_decay_schedule, algo.old_policy_update_interval = None, "linear_to_0_5", 2
    first = trainer.train_step(step)
    trainer.placement.actor_wg.save_checkpoint(str(ckpt))
    second = trainer.train_step(step + 1)
    assert first[0]["old_policy/updated"] == 0.0 and "old_policy/decay" not in first[0]
    assert second[0]["old_policy/updated"] == 1.0 and second[0]["old_policy/decay"] == pytest.approx(0.001 * (step + 2))
    assert second[0]["old_policy/moved_l2"] > 0 and second[0]["old_policy/feedback_rounds"] == step + 2  # lock-step
    return [first, second]


def test_small_trainer_base_is_the_flow_grpo_default():
    cfg = valid(*SMALL_IMAGE_TRAINER)
    assert cfg.actor_rollout_ref.actor.diffusion_loss.loss_mode == "flow_grpo"


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["reward.streaming=false"], ["actor_rollout_ref.hybrid_engine=false"]])
def test_full_finetune_old_copy_samples_and_ships(trainers, layout, tmp_path):
    """A full fine-tune's old policy is a copy of the transformer's weights: the hybrid rollout swaps it in to
    generate, the split layout ships it to the replicas. At decay 1 every sample is the base model's while the live
    transformer moved."""
    full = ["actor_rollout_ref.model.lora_rank=0", "actor_rollout_ref.actor.optim.lr=1e-3"]
    trainer = trainers(*RUN, *full, *layout, "algorithm.old_policy_decay=1.0")
    samples = [s for step in range(2) for s in trainer.train_step(step)[1] if s.version >= 1]
    assert samples
    got = torch.stack([s.result.latents_clean for s in samples])
    assert (got - drawn_full(samples)).abs().max() < 1e-4
    trainer.placement.actor_wg.save_checkpoint(str(tmp_path / "ckpt"))
    state = torch.load(tmp_path / "ckpt" / "actor.pt", weights_only=True)
    assert (got - drawn_full(samples, state["weights"])).abs().max() > 1e-2


def drawn_full(samples, weights: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """What tiny SD3's transformer with ``weights`` (None: as loaded) draws for these samples, in process."""
    from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig

    policy = DiffusionPolicy(
        "tiny:sd3", SamplingConfig(height=32, width=32, num_inference_steps=4, clean_latents=True), lora_rank=0
    )
    if weights is not None:
        policy.load_weights_state_dict(weights)
    out = policy.generate([s.row.prompt for s in samples], [s.seed for s in samples])
    return torch.stack([r.latents_clean for r in out])


@pytest.mark.slow
def test_two_ranks_train_and_refresh_as_one_process(tmp_path):
    """LoRA DiffusionNFT on two actor ranks (gloo) equals one process on the whole batch: the same gradient norm
    (each sample's x_t from its own seed, whichever rank), the same old policy after a refresh on every rank (what a
    sync ships), and a checkpoint that restores it."""
    import ray
    from omegaconf import OmegaConf
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool

    from omni_async.cluster import init_ray, shutdown_ray
    from omni_async.modality.base import model_dtype
    from omni_async.sample import PromptRow, RewardOutcome, Sample
    from omni_async.trainer.actor_core import update_minibatch
    from omni_async.trainer.actor_worker import ActorWorker
    from omni_async.trainer.placement import ActorWorkerGroup
    from omni_async.trainer.step_ops import StepOps

    cfg = compose(
        [
            *[o for o in SMALL_IMAGE_TRAINER if "batch_size=" not in o and "rollout.n=" not in o],
            *RUN,
            "actor_rollout_ref.rollout.n=3",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "algorithm.timestep_fraction=0.5",
            "actor_rollout_ref.actor.optim.lr=1e-3",  # Adam turns rounding-level gradient differences into lr-sized
            # steps on near-zero entries: a small lr keeps the two paths' weights comparable at 1e-6
        ]
    )
    modality = modality_of(cfg)
    m, a = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.actor
    torch.manual_seed(int(cfg.trainer.seed))
    policy = modality.build_policy(
        OmegaConf.to_container(m, resolve=True),
        vars(modality.sampling_config(cfg)),
        "cpu",
        dtype=model_dtype(None, "cpu"),
    )
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=a.optim.lr, weight_decay=a.optim.weight_decay)
    policy.init_old_policy()
    prompts = ["a red sign", "say 12", "a blue door"]
    samples = [
        Sample(p * 3 + k, f"0-{p}", PromptRow(q, "x", ""), 100 + p * 3 + k)
        for p, q in enumerate(prompts)
        for k in range(3)
    ]
    for i, (s, r) in enumerate(
        zip(samples, policy.generate([s.row.prompt for s in samples], [s.seed for s in samples]), strict=True)
    ):
        s.result, s.outcome = r, RewardOutcome("ok", float((i * 7) % 5))
    batch = StepOps(cfg, modality, None, None).build_batch(samples)
    assert batch.batch["train_steps"].shape == (9, 2) and "old_log_probs" not in batch.batch.keys()

    shutdown_ray()
    init_ray(num_gpus=2, num_cpus=16)
    pool = RayResourcePool([2], use_gpu=True, max_colocate_count=1, name_prefix="dp_nft")
    wg = ActorWorkerGroup(
        pool, RayClassWithInitArgs(ray.remote(ActorWorker), config=OmegaConf.to_container(cfg, resolve=True)),
        name_prefix="dp_nft",
    )  # fmt: skip
    try:
        wg.init_model()
        for _ in range(2):
            expected = update_minibatch(modality, policy, optimizer, batch, a)
            got = wg.update_minibatch(batch)
            assert got["actor/grad_norm"] == pytest.approx(expected["actor/grad_norm"], rel=1e-4)
        moved = wg.refresh_old_policy(0.5)
        assert moved[0] == moved[1] == pytest.approx(policy.refresh_old(0.5), rel=1e-4)
        shipped = ray.get([w.get_weights.remote() for w in wg.workers])  # the rollout's weights: the old ones
        want = policy.old_weights_views()
        for k in want:
            assert torch.equal(shipped[0][k], shipped[1][k])
            assert torch.allclose(shipped[0][k], want[k], atol=1e-6), float((shipped[0][k] - want[k]).abs().max())
        wg.save_checkpoint(str(tmp_path))
        wg.refresh_old_policy(0.0)  # the old policy moves on ...
        wg.load_checkpoint(str(tmp_path))  # ... and the checkpoint brings it back
        again = ray.get(wg.workers[1].get_weights.remote())
        assert all(torch.equal(again[k], shipped[0][k]) for k in want)
    finally:
        for w in wg.workers:
            ray.kill(w)
        ray.util.remove_placement_group(pool.get_placement_groups()[0])
        shutdown_ray()
