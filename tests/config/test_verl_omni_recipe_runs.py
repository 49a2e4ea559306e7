"""Every verl-omni diffusion recipe whose algorithm, model family and reward kind exist here trains one step on CPU,
as its user would run it: the recipe's overrides unchanged except the swaps of ``verl_omni_recipe_data.STAND_INS``
(models, engines, reward models, reward functions' files, the reward server) and ``ON_CPU`` (sizes that fit two
cores, the run's own files), each with its reason, through what ``python -m omni_async.trainer.main`` runs (the
override check and compose, ``make_trainer(cfg).fit()``, Ray shut down after). The step must have *trained*: one metrics
row with the loss mode's loss and a gradient norm finite and > 0, rewards that differ within the groups, the
checkpoint's LoRA ``B`` matrices (zero at start) moved by the optimizer.

Recipes that differ only in keys that pick no code path here (``CODE_PATH_NEUTRAL``, each with why) share one run:
``RUNS`` says which run covers which recipe, and ``test_one_run_covers_recipes_of_one_effective_config`` checks that
the recipes a run covers compose to its effective config. A recipe refused at its real world size only because its
mini-batch has fewer prompt groups than data-parallel ranks (``WORLD_SIZE_REFUSAL``: the two 64-card recipes) trains
at ON_CPU's one rank like every other. The nsys recipe's profiling keys (``PROFILING``) pick no code path of the
training either: its group runs it, under a stand-in ``nsys`` (``nsys_stand_in.py``), and checks that actor rank 0
started under it with the recipe's worker options and nothing else did. The recipes refused at start, before Ray, are
tested in ``test_verl_omni_recipes.py`` (``test_each_recipe_starts_or_is_refused_before_ray_naming_what_is_missing``).

Runs join the test session's Ray cluster (``conftest.py``), one Ray job each."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TOOLS_ENV
from helpers import write_ocr_rows
from verl_omni_recipe_data import effective, on_cpu, profiles, recipes, runs, stand_in, trainable

from omni_async.cluster import shutdown_ray
from omni_async.trainer.config import compose
from omni_async.trainer.offline_trainer import make_trainer

RECIPES = recipes()
# One training run per effective config: the runner -> every recipe it covers (itself first). What each covered
# recipe differs in, and why that picks no code path, is in CODE_PATH_NEUTRAL.
RUNS: dict[str, list[str]] = {
    # Wan 2.2 video, a full fine-tune; verl-omni's HPSv3 reward stood in by verl_omni_hpsv3_stand_in (its contract)
    "dancegrpo_trainer.wan22.run_wan22_5b_t2v_hpsv3_auto": ["dancegrpo_trainer.wan22.run_wan22_5b_t2v_hpsv3_auto"],
    "diffusionnft_trainer.qwen_image.run_qwen_image_ocr_lora": [
        "diffusionnft_trainer.qwen_image.run_qwen_image_ocr_lora"
    ],
    "diffusionopd_trainer.sd35.run_sd35_medium_ocr_distill": ["diffusionopd_trainer.sd35.run_sd35_medium_ocr_distill"],
    "dpo_trainer.qwen_image.run_qwen_image_online_dpo_lora": ["dpo_trainer.qwen_image.run_qwen_image_online_dpo_lora"],
    "dpo_trainer.sd35.run_sd35_medium_offline_dpo_lora": ["dpo_trainer.sd35.run_sd35_medium_offline_dpo_lora"],
    "flowdppo_trainer.qwen_image.run_qwen_image_ocr_lora": ["flowdppo_trainer.qwen_image.run_qwen_image_ocr_lora"],
    # the nsys recipe, under the nsys stand-in (nsys_on_ray_path): its profiling keys pick no code path of the
    # training (PROFILING), so it trains what the four below do
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_fsdp2_benchmark_nsys": [
        "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_fsdp2_benchmark_nsys",
        "flowgrpo_trainer.qwen_image.run_qwen_image_ocr",
        # 64 cards, refused at that world size (WORLD_SIZE_REFUSAL), shrunk to ON_CPU's one rank as every run is
        "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_fsdp2_64cards",
        "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_fsdp2_benchmark",  # worker counts, vLLM judge knobs, logs
        # the judge's free_cache_engine (no effect: upstream_keys) and gpu_memory_utilization
        "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_h200_mfu_optimized",
    ],
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora": [
        "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora",
        "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_fsdp2_fa3",  # clip_ratio; attention backends (no effect)
        # two nodes (one here, ON_CPU); offload_policy=true = the param_offload + optimizer_offload it also sets
        "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_multi_node",
    ],
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_async_reward": [
        "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_async_reward"
    ],
    # Ulysses sp=2: one sequence-parallel group of 2 actor ranks (ON_CPU_SEQUENCE_PARALLEL), each half of the tokens
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_sp2": [
        "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_sp2"
    ],
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_rollout_corr": [  # bypass mode with rollout_is / rs
        "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_rollout_corr"
    ],
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_multi_reward": [
        "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_multi_reward"
    ],
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_reward_server": [
        "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_reward_server"
    ],
    "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_veomni": [
        "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_veomni",
        "flowgrpo_trainer.qwen_image.run_qwen_image_ocr_veomni_64cards",  # the same: 64 cards, shrunk to one rank
    ],
    # Qwen-Image-Edit-2511: the tiny edit set's input images, a reward reading them (verl_omni_pickscore_stand_in)
    "flowgrpo_trainer.qwen_image_edit.run_qwen_image_edit_lora": [
        "flowgrpo_trainer.qwen_image_edit.run_qwen_image_edit_lora"
    ],
    # output_type=latent: the clean latent and the prompt encodings to verl-omni's DRM client (its stand-in);
    # rollout.dtype=float32 from bf16 weights, pi_old recomputed in bf16
    "flowgrpo_trainer.sd35.run_sd35_medium_drm_lora": ["flowgrpo_trainer.sd35.run_sd35_medium_drm_lora"],
    "flowgrpo_trainer.sd35.run_sd35_medium_ocr_lora": [
        "flowgrpo_trainer.sd35.run_sd35_medium_ocr_lora",
        "flowgrpo_trainer.sd35.run_sd35_medium_ocr_lora_v1",  # verl v1's spelling of the same (sync) mode
    ],
    "flowgrpo_trainer.sd35.run_sd35_medium_ocr_lora_v1_separate_async": [
        "flowgrpo_trainer.sd35.run_sd35_medium_ocr_lora_v1_separate_async"
    ],
    "grpoguard_trainer.qwen_image.run_qwen_image_ocr_lora": ["grpoguard_trainer.qwen_image.run_qwen_image_ocr_lora"],
    "mixgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_mixgrpo": [
        "mixgrpo_trainer.qwen_image.run_qwen_image_ocr_lora_mixgrpo"
    ],
}
# The loss each loss mode logs (verl's actor/pg_loss for the policy-gradient ones).
LOSS_METRIC = {
    "flow_grpo": "actor/pg_loss",
    "dance_grpo": "actor/pg_loss",
    "grpo_guard": "actor/pg_loss",
    "flow_dppo": "actor/pg_loss",
    "diffusion_nft": "actor/policy_loss",
    "dpo": "actor/dpo_loss",
    "distill_kl": "actor/distill_kl_loss",
}


def test_one_run_covers_recipes_of_one_effective_config():
    """The recipes that start here are exactly those RUNS covers, grouped by their effective config (stand-ins and
    ON_CPU applied, CODE_PATH_NEUTRAL keys left out): each covered recipe composes to its run's."""
    assert runs(trainable()) == RUNS
    for runner, covered in RUNS.items():
        mine = effective(on_cpu(stand_in(RECIPES[runner]), "/data", "/run"))
        for other in covered[1:]:
            assert effective(on_cpu(stand_in(RECIPES[other]), "/data", "/run")) == mine, other


def base_transformer(path: str) -> dict[str, torch.Tensor]:
    """The untrained transformer's weights, as the model directory holds them; Wan 2.2's two experts (transformer/,
    transformer_2/) under their folder's name, as the checkpoint keeps them."""
    from safetensors.torch import load_file

    from omni_async.models.tiny import resolve_model_path

    state: dict[str, torch.Tensor] = {}
    folders = sorted(p for p in Path(resolve_model_path(path)).glob("transformer*") if p.is_dir())
    for folder in folders:
        prefix = f"{folder.name}." if len(folders) > 1 else ""
        for f in sorted(folder.glob("*.safetensors")):
            state.update({prefix + k: v for k, v in load_file(f).items()})
    assert state, f"no safetensors under {path}/transformer"
    return state


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("prompts")
    write_ocr_rows(d / "train.jsonl", 4)
    write_ocr_rows(d / "val.jsonl", 2)
    return d


@pytest.fixture(scope="module")
def wall():
    """Each run's wall time, printed at the end of the module (``-s``)."""
    times: dict[str, float] = {}
    yield times
    print("\nrecipe runs (s): " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))


@pytest.fixture
def nsys_on_ray_path(tmp_path, monkeypatch):
    """``nsys_stand_in.py`` as ``nsys`` on the PATH of the Ray cluster the run uses (Ray's nsight plugin calls it from
    the raylet's PATH): the shared cluster's stand-in directory (``conftest``), or, for a cluster the run starts
    itself, a directory put first on PATH here. Yields the file the stand-in logs its calls to."""
    tools = os.environ.get(TOOLS_ENV)
    if tools is None:
        if os.environ.get("RAY_ADDRESS"):
            pytest.skip("the Ray cluster at RAY_ADDRESS was started without a stand-in directory on its PATH")
        tools = str(tmp_path / "tools")
        os.makedirs(tools)
        monkeypatch.setenv("PATH", tools + os.pathsep + os.environ.get("PATH", ""))
    nsys, log = Path(tools) / "nsys", Path(tools) / "nsys_calls.jsonl"
    nsys.write_text(f"#!{sys.executable}\n" + (Path(__file__).parent / "nsys_stand_in.py").read_text())
    nsys.chmod(0o755)
    log.unlink(missing_ok=True)
    yield log
    nsys.unlink(missing_ok=True)
    log.unlink(missing_ok=True)


@pytest.mark.slow  # a training run each
@pytest.mark.parametrize("runner", sorted(RUNS))
def test_recipe_trains_one_step(runner, data, tmp_path, request, wall):
    t0 = time.perf_counter()
    recipe = RECIPES[runner]
    nsys_log = request.getfixturevalue("nsys_on_ray_path") if profiles(recipe) else None
    scorer_url = "http://127.0.0.1:1"
    if any(line.startswith("+reward.reward_functions.ocr.server_url=") for line in recipe):
        scorer_url = request.getfixturevalue("server_factory")("--scorer", "jpeg").url
    cfg = compose(on_cpu(stand_in(recipe, scorer_url=scorer_url), data, tmp_path / "run"))  # as main.py composes
    assert not cfg.trainer.val_before_train and cfg.trainer.test_freq != 1  # CODE_PATH_NEUTRAL: no validation
    shutdown_ray()
    try:
        run_dir = make_trainer(cfg).fit()
    finally:
        shutdown_ray()
    wall[runner] = time.perf_counter() - t0

    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1
    loss = row[LOSS_METRIC[cfg.actor_rollout_ref.actor.diffusion_loss.loss_mode]]
    assert math.isfinite(loss), row
    assert math.isfinite(row["actor/grad_norm"]) and row["actor/grad_norm"] > 0, row
    # rewards came back for every sample and differ within the groups (else the advantages are 0)
    assert row["reward/failed"] == 0 and row["critic/rewards/std"] > 0 and row["critic/rewards/zero_std_ratio"] < 1
    if cfg.algorithm.sample_source == "online":  # offline DPO: the step's 2 pairs, nothing generated or queued
        assert row["perf/total_num_images"] == 4 and row.get("reward_queue/total_consumed", 4) == 4  # streamed: 4 too
    for key in cfg.reward.reward_functions:  # each of several rewards scored (verl-omni's file: its own arguments)
        assert math.isfinite(row[f"reward/{key}"]) and row[f"reward/{key}"] != 0, (key, row)
    rc = cfg.algorithm.rollout_correction
    if rc.rollout_is or rc.rollout_rs:  # bypass mode: verl's IS weights / RS mask per loss call, under verl's names
        assert any(k.startswith("actor/rollout_corr/") for k in row), sorted(row)
    state = torch.load(next(run_dir.glob("checkpoints/step_000001/actor.pt")), weights_only=True)
    model = cfg.actor_rollout_ref.model
    if model.lora_rank > 0:
        lora_b = [v for k, v in state["weights"].items() if "lora_B" in k]
        assert lora_b and any(v.abs().sum() > 0 for v in lora_b)  # zero at start: the optimizer moved them
    else:  # a full fine-tune (verl's lora_rank=0, the recipe sets no rank): the transformer's own weights moved
        start = base_transformer(model.path)
        trained = state["weights"]
        assert trained.keys() == start.keys()  # the whole transformer, no adapter
        moved = [k for k in start if not torch.equal(trained[k].to(start[k].dtype), start[k])]
        assert moved, "no weight of the transformer moved"
    assert all(s["step"] >= 1 for s in state["optimizer"]["state"].values())
    if (
        nsys_log is not None
    ):  # actor.profiler.ranks=[0]: rank 0 started under nsys with the worker options, nothing else
        calls = [json.loads(line) for line in nsys_log.read_text().splitlines()]
        workers = [c for c in calls if any(a.endswith("default_worker.py") for a in c["command"])]
        assert [w["rank"] for w in workers] == ["0"], calls
        (worker,) = workers
        report = Path(worker["report"])  # the recipe's -o, %q{RANK} / %h / %p expanded, under Ray's nsight directory
        assert report.exists() and report.name.startswith("actor_update_20260101_000000_PID_rank_0_"), report
        assert report.parent.name == "nsight", report
        options = worker["options"]
        assert options["capture-range"] == "cudaProfilerApi" and options["trace"] == "nvtx", options
        assert options["python-sampling-frequency"] == "20" and options["kill"] == "none", options
