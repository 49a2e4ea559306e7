"""Data parallelism on real Ray actor workers (CPU, gloo): two ranks on half-batches train exactly as one process on
the whole batch, for LoRA (all-reduced gradients) and a full fine-tune (FSDP2), images and text, with a failed
sample on one rank only and unequal micro-batch counts; each sample is trained on by exactly one rank; a save is one
checkpoint set, read back by the two ranks and by one process (FSDP2: resharded 2 -> 1); rank 0 generates alone on
the trained weights (FSDP2: the gathered ones) and its samples are the single process's; a rank that raises
between collectives stops the other at once, whose error names it (not a wait for the collective timeout)."""

from __future__ import annotations

import copy
import os

import pytest
import ray
import torch
from omegaconf import OmegaConf
from ray.exceptions import RayTaskError

from omni_async.agent_loop.draws import Draws
from omni_async.cluster import init_ray, shutdown_ray
from omni_async.modality import get_modality
from omni_async.modality.base import model_dtype
from omni_async.sample import PromptRow, RewardOutcome, Sample
from omni_async.trainer.actor_core import compute_log_prob, update_minibatch
from omni_async.trainer.actor_worker import ActorWorker
from omni_async.trainer.config import compose, validate
from omni_async.trainer.data_parallel import DataParallel, load_actor, shard_batch
from omni_async.trainer.placement import ActorWorkerGroup
from omni_async.trainer.step_ops import StepOps

pytestmark = pytest.mark.slow  # training runs: not in the fast tier (pytest -m 'not slow')

PROMPTS, N = ["a red sign", "say 12", "a blue door"], 3  # 3 groups of 3: ranks get 2 groups and 1
IMAGE = [
    "actor_rollout_ref.model.path=tiny:sd3",
    "actor_rollout_ref.rollout.num_inference_steps=4",
    "actor_rollout_ref.rollout.height=32",
    "actor_rollout_ref.rollout.width=32",
    "actor_rollout_ref.rollout.algo.sde_window_range=[0,3]",
]
TEXT = ["actor_rollout_ref.rollout.response_length=6"]
COMMON = [
    f"actor_rollout_ref.rollout.n={N}",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.agent.max_batch_size=1",
]
CASES = {
    "image-lora": ("flowgrpo_trainer", [*IMAGE, "actor_rollout_ref.model.lora_rank=4"]),
    "image-fsdp2": ("flowgrpo_trainer", [*IMAGE, "actor_rollout_ref.model.lora_rank=0"]),
    "text-lora": ("grpo_text_trainer", [*TEXT, "actor_rollout_ref.model.lora_rank=4"]),
    "text-fsdp2": ("grpo_text_trainer", [*TEXT, "actor_rollout_ref.model.lora_rank=0"]),
}

# How gloo says a peer tore the group down under a pending collective: "closed by peer" or "reset by peer",
# depending on where the read was when the peer left.
PEER_GONE = ("closed by peer", "reset by peer")


def one_process(cfg):
    """The single-rank reference, built as ``ActorWorker._init_model`` builds its policy."""
    modality = get_modality(cfg.actor_rollout_ref.model.modality)
    m, a = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.actor
    torch.manual_seed(int(cfg.trainer.seed))
    policy = modality.build_policy(
        OmegaConf.to_container(m, resolve=True),
        vars(modality.sampling_config(cfg)),
        "cpu",
        dtype=model_dtype(a.fsdp_config.model_dtype, "cpu"),
    )
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=a.optim.lr, weight_decay=a.optim.weight_decay)
    return modality, policy, optimizer


def generate(policy, modality, prompts, seeds, windows):
    if modality.uses_window:
        return policy.generate(prompts, seeds, [range(*w) for w in windows])
    return policy.generate(prompts, seeds)


def make_batch(cfg, modality, policy):
    """One step's batch through StepOps.build_batch; sample 1 (group 0, rank 0's) failed."""
    ops = StepOps(cfg, modality, None, None)
    draws = Draws.from_config(cfg, None, modality.uses_window)
    samples = [
        Sample(
            index=p * N + k,
            uid=f"0-{p}",
            row=PromptRow(prompt, "x", ""),
            seed=100 + p * N + k,
            window=draws.window(0, p * N + k),
        )
        for p, prompt in enumerate(PROMPTS)
        for k in range(N)
    ]
    results = generate(
        policy, modality, [s.row.prompt for s in samples], [s.seed for s in samples], [s.window for s in samples]
    )
    for i, (s, r) in enumerate(zip(samples, results, strict=True)):
        s.result = r
        s.outcome = RewardOutcome("failed", error="x") if i == 1 else RewardOutcome("ok", float((i * 7) % 5))
    return ops.build_batch(samples), samples[0].window


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def ray_session():
    shutdown_ray()
    init_ray(num_gpus=2, num_cpus=16)
    # The in-process reference runs with one torch thread, as each rank does (cluster.configure_worker): a CPU
    # reduction's order depends on the thread count, which moves fp32 weights by ~1e-6 after two Adam steps.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    shutdown_ray()


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_on_half_batches_equal_one_process_on_the_batch(case, ray_session, tmp_path, monkeypatch):
    import verl.single_controller.ray.base as verl_ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool

    # Rank 0 is on the driver's node: the ranks meet at an address found here, without verl's Ray task.
    monkeypatch.setattr(verl_ray, "get_master_addr_port", None)

    config_name, overrides = CASES[case]
    # validated as a run is: its null defaults (kl_loss_coef, bypass_mode) resolved
    cfg = validate(compose(["data.train_files=unused.jsonl", *COMMON, *overrides], config_name=config_name))
    modality, policy, optimizer = one_process(cfg)
    batch, window = make_batch(cfg, modality, policy)
    log_probs = compute_log_prob(modality, policy, batch)

    pool = RayResourcePool([2], use_gpu=True, max_colocate_count=1, name_prefix=f"dp_{case}")
    wg = ActorWorkerGroup(
        pool,
        RayClassWithInitArgs(ray.remote(ActorWorker), config=OmegaConf.to_container(cfg, resolve=True)),
        name_prefix=f"dp_{case.replace('-', '_')}",
    )
    assert wg.master_address == ray.util.get_node_ip_address()
    try:
        wg.init_model()
        assert torch.allclose(wg.compute_log_prob(batch), log_probs, atol=1e-5)  # shares back in batch order
        for _ in range(2):
            expected = update_minibatch(modality, policy, optimizer, batch, cfg.actor_rollout_ref.actor)
            got = wg.update_minibatch(batch)
            assert got["actor/grad_norm"] == pytest.approx(expected["actor/grad_norm"], rel=1e-4)
        assert got["perf/samples_per_rank"] == 6.0  # two groups of three on the busier rank
        reference = {k: v.detach() for k, v in policy.weights_state_dict().items()}
        weights = ray.get([w.get_weights.remote() for w in wg.workers])
        assert max_diff(weights[0], reference) < 1e-6
        assert max_diff(weights[0], weights[1]) == 0.0  # one model on every rank
        rows = ray.get([w.trained_rows.remote() for w in wg.workers])
        seen = [sorted({i for _, i in r}) for r in rows]
        assert seen == [[0, 1, 2, 6, 7, 8], [3, 4, 5]]  # whole groups; the failed sample 1 on rank 0 only
        assert all(len(r) == 2 * len(s) for r, s in zip(rows, seen, strict=True))  # each once per step, 2 steps

        # One checkpoint set; a one-rank process reads it (LoRA: rank 0's file; FSDP2: DCP reshards 2 -> 1).
        wg.save_checkpoint(str(tmp_path))
        assert sorted(os.listdir(tmp_path)) == (["actor.pt"] if "lora" in case else ["actor_dcp"])
        wg.load_checkpoint(str(tmp_path))  # the two ranks read it back
        assert max_diff(ray.get(wg.workers[1].get_weights.remote()), weights[0]) == 0.0
        with torch.no_grad():
            for p in policy.trainable_parameters():
                p.add_(1.0)
        load_actor(tmp_path, policy, optimizer, DataParallel())
        assert max_diff({k: v.detach() for k, v in policy.weights_state_dict().items()}, weights[0]) == 0.0

        # Rank 0 generates alone (rank 1 idle: no collective), on the trained weights.
        gen = ray.get(wg.workers[0].generate.remote(PROMPTS[0], 5, window))
        ref = generate(policy, modality, [PROMPTS[0]], [5], [window])[0]
        got_lp, ref_lp = gen.result.log_probs, ref.log_probs
        assert torch.allclose(torch.as_tensor(got_lp), torch.as_tensor(ref_lp), atol=1e-4)

        if case == "text-lora":  # last: rank 1 raises between collectives (out-of-vocabulary tokens in its group)
            bad = copy.deepcopy(batch)
            bad.batch["response_ids"][3:6] = 10**6  # group 1: rank 1's share
            refs = [w.update_minibatch.remote(s) for w, s in zip(wg.workers, shard_batch(bad, 2), strict=True)]
            errors = []
            for ref in refs:  # rank 0 waits in the gradient all-reduce: it must not wait for nccl_timeout (600 s)
                with pytest.raises(RayTaskError) as exc:
                    ray.get(ref, timeout=120)  # a guard against a hang, far below nccl_timeout; not what is tested
                errors.append(str(exc.value))
            assert "IndexError" in errors[1]  # rank 1's own error
            assert "RankFailedError: actor rank 1 failed" in errors[0] and "IndexError" in errors[0], errors[0]
            # What ended rank 0's all-reduce: rank 1 tearing the group down (gloo: the peer closed or reset the
            # connection), not the collective's timeout (gloo: "Timed out waiting ...").
            assert any(w in errors[0] for w in PEER_GONE) and "Timed out" not in errors[0], errors[0]
    finally:
        for w in wg.workers:
            ray.kill(w)
        ray.util.remove_placement_group(pool.get_placement_groups()[0])
