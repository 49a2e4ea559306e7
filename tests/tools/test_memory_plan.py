"""The memory plan measures (meta device, no weights): the real Qwen-Image sizes, activations that react to
checkpointing and resolution, the rollout at the config's request batch, every layout's device total (hybrid LoRA and
full fine-tune, rollout worker, trainer rank), and the default GPU recipe fitting an 80 GB device.

Every figure is measured on the full 60-block transformer (no per-block extrapolation); the module-scoped plan
runs three meta forward/backward passes at 512² (one of the full fine-tune), two no-grad forwards (512² and 1024²), two
text-encoder forwards (batch 8 and 1), two VAE decodes and two AdamW steps: 45 CPU-s for a pytest process running
this file alone, its imports and Ray's start included (measured 2026-11-26; wall time grows when the cores are
shared). The 1024² training figures are the plan's command's
(``bench/results/memory_plan.json``), not re-measured here, except the Ulysses test's two passes without checkpointing
(sp=1 and sp=2 on the plan's cached model: 8 s more, measured 2026-11-27 at load 6)."""

from __future__ import annotations

import functools
import json

import pytest

mp = pytest.importorskip("omni_async.tools.memory_plan")
ml = pytest.importorskip("omni_async.tools.memory_layouts")


@pytest.fixture(scope="module")
def qwen_plan():
    """Qwen-Image, LoRA r64, micro-batch 1 with CFG on (batch 2): training at 512² (ckpt on/off; full fine-tune ckpt
    on), rollout at 512² and 1024² (the config's request batch, x2 for CFG), VAE decode at 512²."""
    rollout_batch = mp.default_rollout_batch()
    plan = {"weights": {}, "micro_batch": 1, "rollout_batch": rollout_batch, "frames": 1, "resolutions": {}}
    for part in ("transformer", "text_encoder", "vae"):
        count, size = mp.nbytes(mp.component("qwen_image", part))
        plan["weights"][part] = {"params": count, "gb": size / mp.GB}
    _, lora_params = mp.lora_transformer("qwen_image", 64)
    plan["lora"] = {"rank": 64, "params": lora_params, "gb": 16 * lora_params / mp.GB}
    plan["text_encoder_forward_gb"] = mp.measure_text_encoder("qwen_image", rollout_batch)
    plan["optimizer_step_gb"] = mp.measure_optimizer_step("qwen_image", 64)
    plan["lora_allreduce_bucket_gb"] = mp.measure_allreduce_bucket("qwen_image", 64)
    block = mp.largest_block_params("qwen_image")
    plan["full"] = {
        "params": plan["weights"]["transformer"]["params"],
        "largest_block_params": block,
        "fsdp_buffers_gb": 8 * block / mp.GB,
        "optimizer_step_gb": mp.measure_optimizer_step("qwen_image", 0),
    }
    for res, modes in ((512, (True, False)), (1024, ())):
        plan["resolutions"][str(res)] = {
            "train": {
                f"cfg/{'ckpt' if c else 'no_ckpt'}": mp.measure_train("qwen_image", res, 2, c, 64) for c in modes
            },
            "rollout_gb": {"cfg": mp.measure_rollout("qwen_image", res, 2 * rollout_batch, 64)},
        }
    low = plan["resolutions"]["512"]
    low["train_full"] = {"cfg/ckpt": mp.measure_train("qwen_image", 512, 2, True, 0)}
    low["vae_decode_gb"] = {t: mp.measure_vae_decode("qwen_image", 512, tiled=t == "tiled") for t in ("plain", "tiled")}
    return plan


@pytest.mark.slow  # the shared plan measures the full 60-block model (~50 s)
def test_qwen_image_sizes_are_the_real_model(qwen_plan):
    weights = qwen_plan["weights"]
    assert abs(weights["transformer"]["params"] / 20.4e9 - 1) < 0.02
    assert weights["transformer"]["gb"] == pytest.approx(2 * weights["transformer"]["params"] / 1e9, rel=1e-3)
    assert 8.0e9 < weights["text_encoder"]["params"] < 8.5e9  # Qwen2.5-VL-7B with its vision tower
    assert 0.05e9 < weights["vae"]["params"] < 0.3e9
    # r64 on 8 projections (3072 -> 3072) of 60 blocks: 60 * 8 * 64 * (3072 + 3072)
    assert qwen_plan["lora"]["params"] == 60 * 8 * 64 * 2 * 3072
    # the 60 dual-stream blocks hold almost all of the 20.4 B parameters
    full = qwen_plan["full"]
    assert 0.95 * full["params"] < 60 * full["largest_block_params"] <= full["params"]


@pytest.mark.slow  # the shared plan measures the full 60-block model (~50 s)
def test_default_gpu_recipe_fits_80gb_as_sold(qwen_plan):
    """512², LoRA r64, checkpointing on, micro-batch 1, bf16 frozen weights, CFG on (2 branches in the update and in
    rollout), rollout at agent.max_batch_size requests, 4 data-parallel ranks (NCCL buffers), the rollout snapshot
    adapter (an overlap mode), text encoder and VAE kept on the GPU through the update (the stricter case), plain VAE
    decode (images), allocator fragmentation and the CUDA context: within 80 GB as sold = 80e9 bytes (not 80 GiB)."""
    assert ml.DEVICES_GB["H100 80GB"] * ml.GB == 80e9
    peak = mp.device_peak(
        qwen_plan, 512, cfg=True, ckpt=True, offload_encoders=False, layout="hybrid", ranks=4, snapshot=True
    )
    assert peak["peak_gb"] <= 80.0, peak
    assert peak["peak_gb"] == pytest.approx(
        peak["allocated_gb"] * (1 + ml.FRAGMENTATION) + ml.RUNTIME_RESERVE_GB + ml.NCCL_RESERVE_GB
    )
    at_512 = {**qwen_plan, "resolutions": {"512": qwen_plan["resolutions"]["512"]}}
    rec = mp.recommend(at_512, 80.0, cfg=True, ranks=4)["512"]
    assert any(o["gradient_checkpointing"] and not o["offload_encoders_during_update"] for o in rec["options"])


@pytest.mark.slow  # the shared plan measures the full 60-block model (~50 s)
def test_rollout_is_planned_at_the_configs_request_batch(qwen_plan):
    """The rollout and the text encoder run agent.max_batch_size requests at once, not one micro-batch."""
    assert qwen_plan["rollout_batch"] == 8  # flowgrpo_trainer.yaml's agent.max_batch_size
    one = mp.measure_text_encoder("qwen_image", 1)
    assert qwen_plan["text_encoder_forward_gb"] > 4 * one > 0
    # the plain decode of an image (vae_tiling is off for images) costs more than the tiled one
    vae = qwen_plan["resolutions"]["512"]["vae_decode_gb"]
    assert vae["plain"] > 2 * vae["tiled"]


@pytest.mark.slow  # the shared plan measures the full 60-block model (~50 s)
def test_every_layout_counts_what_it_holds(qwen_plan):
    """Hybrid LoRA vs full fine-tune (FSDP2 shards + gathered bf16 for generation), the rollout-only worker (frozen
    pipeline, no optimizer / gradients / training activations) and the trainer rank (no encoders)."""
    w, lora, full = qwen_plan["weights"], qwen_plan["lora"], qwen_plan["full"]
    encoders = w["text_encoder"]["gb"] + w["vae"]["gb"]
    peak = functools.partial(mp.device_peak, qwen_plan, 512, True, True, False)
    hybrid, no_snapshot = peak(ranks=4), peak(ranks=4, snapshot=False)
    assert hybrid["rollout_gb"] - no_snapshot["rollout_gb"] == pytest.approx(4 * lora["params"] / ml.GB)
    rollout = peak(layout="rollout")
    assert mp.rollout_worker_peak(qwen_plan, 512, True) == pytest.approx(rollout["peak_gb"])
    # no optimizer state, gradients or snapshot: the fp32 adapter it generates with instead of 16 + 4 bytes each
    assert rollout["update_gb"] == 0.0
    assert rollout["rollout_gb"] == pytest.approx(hybrid["rollout_gb"] - 16 * lora["params"] / ml.GB)
    assert rollout["rollout_gb"] >= w["transformer"]["gb"] + encoders
    trainer = peak(layout="trainer", ranks=4)
    assert trainer["rollout_gb"] == 0.0 and trainer["update_gb"] < hybrid["update_gb"] - encoders + 1e-9
    # Full fine-tune on 4 ranks: 16 bytes per parameter sharded + the gathered bf16 model for generation
    fx4, fx8 = peak(full=True, ranks=4), peak(full=True, ranks=8)
    shards4 = 16 * full["params"] / 4 / ml.GB
    assert fx4["rollout_gb"] == pytest.approx(
        shards4
        + w["transformer"]["gb"]
        + encoders
        + max(
            qwen_plan["text_encoder_forward_gb"],
            qwen_plan["resolutions"]["512"]["rollout_gb"]["cfg"],
            qwen_plan["resolutions"]["512"]["vae_decode_gb"]["plain"],
        )
    )
    assert fx8["peak_gb"] < fx4["peak_gb"]
    # a foreach AdamW step over fp32 masters needs one fp32 temporary of the (sharded) parameters
    assert full["optimizer_step_gb"] == pytest.approx(4 * full["params"] / ml.GB, rel=0.01)
    rows = ml.layout_rows({**qwen_plan, "resolutions": {"512": qwen_plan["resolutions"]["512"]}})
    assert {
        "hybrid LoRA",
        "rollout worker LoRA",
        "trainer rank LoRA",
        "rollout worker full",
        "hybrid full x4",
        "trainer rank full x8",
    } <= set(rows)


def test_images_decode_plain_and_video_tiled():
    """The VAE decode the plan counts follows the policy's default: plain for images, tiled for video."""
    plan = _fake_plan()
    plan["resolutions"]["512"]["vae_decode_gb"] = {"plain": 9.0, "tiled": 0.2}
    image = mp.device_peak({**plan, "frames": 1}, 512, True, True, False)
    video = mp.device_peak({**plan, "frames": 33}, 512, True, True, False)
    assert image["rollout_gb"] - video["rollout_gb"] == pytest.approx(9.0 - 0.2)
    assert mp.device_peak({**plan, "frames": 1}, 512, True, True, False, vae_tiled=True)["rollout_gb"] == pytest.approx(
        video["rollout_gb"]
    )


@pytest.mark.slow  # the shared plan measures the full 60-block model (~50 s)
def test_activations_are_measured(qwen_plan):
    low, high = qwen_plan["resolutions"]["512"], qwen_plan["resolutions"]["1024"]
    no_ckpt, ckpt = low["train"]["cfg/no_ckpt"], low["train"]["cfg/ckpt"]
    assert ckpt["peak_gb"] < no_ckpt["peak_gb"] / 5  # 60 blocks: only block inputs + one block's recompute
    assert ckpt["held_gb"] < no_ckpt["held_gb"] / 10
    assert no_ckpt["saved_gb"] == pytest.approx(no_ckpt["held_gb"], rel=0.02)  # hook count == live tensors
    # 4x the image tokens at 1024²: measured on the rollout (a forward of the same 60 blocks, 1/4 of a training
    # pass's cost here; bench/results/memory_plan.json has the 1024² training figures)
    assert high["rollout_gb"]["cfg"] > 2 * low["rollout_gb"]["cfg"] > 0
    # a steady AdamW step (foreach) needs one fp32 temporary the size of the LoRA params
    assert qwen_plan["optimizer_step_gb"] == pytest.approx(qwen_plan["lora"]["gb"] / 4, rel=0.05)
    assert no_ckpt["peak_gb"] >= no_ckpt["held_gb"]
    # checkpointing keeps exactly the 60 block inputs (image + text stream, bf16) beyond the small extras
    tokens = 2 * ((512 // 16) ** 2 + 256)
    assert ckpt["held_gb"] >= 60 * tokens * 3072 * 2 / 1e9


@pytest.mark.slow  # two meta forward/backward passes of the 60 blocks at 1024² (~8 s; the model is the plan's, cached)
def test_ulysses_sp2_halves_one_ranks_training_activations():
    """One rank of Ulysses sp=2 (diffusers' own context-parallel hooks and Ulysses attention, collectives emulated)
    keeps about half of sp=1's activations for backward and peaks lower: Qwen-Image at 1024², CFG (batch 2), no
    checkpointing (the case activations dominate; --sp in the plan's command measures checkpointing too)."""
    one, two = (mp.measure_train("qwen_image", 1024, 2, False, 64, sp=n) for n in (1, 2))
    assert two["peak_gb"] < 0.6 * one["peak_gb"]
    # a group generating together: one rank's no-grad denoising forward (CFG's 2 rows) peaks at about half
    assert 0.4 < mp.measure_rollout("qwen_image", 512, 2, 64, sp=2) / mp.measure_rollout("qwen_image", 512, 2, 64) < 0.6
    assert 0.4 < two["held_gb"] / one["held_gb"] < 0.6
    assert two["saved_gb"] == pytest.approx(two["held_gb"], rel=0.02)  # the hooks see what the tracker holds
    module, _ = mp.lora_transformer("qwen_image", 64)  # the emulation is undone: no hook, no parallel config left
    assert not any(getattr(m, "_diffusers_hook", None) and m._diffusers_hook.hooks for m in module.modules())
    assert all(
        getattr(m.processor, "_parallel_config", None) is None for m in module.modules() if hasattr(m, "processor")
    )


def test_ulysses_rows_change_only_the_training_micro_batch():
    """sp > 1 reads one rank's measured training micro-batch; weights, LoRA state and the rollout stay; the group's
    two communicators are added; a full fine-tune, a rollout worker, ranks not a multiple of sp and an unmeasured
    degree are refused."""
    plan = _fake_plan()
    entry = plan["resolutions"]["512"]
    entry["train_sp"] = {"2": {key: {**t, "peak_gb": 0.6} for key, t in entry["train"].items()}}
    base = ml.device_peak(plan, 512, True, True, False, ranks=2)
    sp2 = ml.device_peak(plan, 512, True, True, False, ranks=2, sp=2)
    assert sp2["rollout_gb"] == base["rollout_gb"]
    assert base["update_gb"] - sp2["update_gb"] == pytest.approx(1.5 - 0.6)
    assert sp2["runtime_gb"] - base["runtime_gb"] == pytest.approx(2 * ml.NCCL_RESERVE_GB)
    rows = ml.layout_rows(plan)
    assert rows["hybrid LoRA sp2"]["512"] == sp2
    assert rows["trainer rank LoRA sp2"]["512"] == ml.device_peak(
        plan, 512, True, True, False, ranks=2, sp=2, layout="trainer"
    )
    assert "hybrid LoRA sp4" not in rows
    # 4 GB over sp=1's micro-batch 1: sp=1 adds 1.65 GB per micro-batch (1.5 + fragmentation), sp=2 0.66 after its
    # 2 GB of communicators
    fit = base["peak_gb"] + 4.0
    micro = {n: ml.recommend(plan, fit, True, ranks=2, sp=n)["512"]["options"][0]["max_micro_batch"] for n in (1, 2)}
    assert micro == {1: 3, 2: 5}
    for kw, match in (
        ({"full": True, "ranks": 2}, "LoRA only"),
        ({"layout": "rollout", "ranks": 2}, "hybrid or trainer"),
        ({"ranks": 3}, "multiple of 2"),
    ):
        with pytest.raises(ValueError, match=match):
            ml.device_peak(plan, 512, True, True, False, sp=2, **kw)
    with pytest.raises(ValueError, match="--sp"):
        ml.device_peak(plan, 512, True, True, False, ranks=4, sp=4)


def test_a_group_generating_together_reads_one_ranks_denoising_forward():
    """``split_generation`` (the hybrid group is one rollout worker) swaps the rollout phase's denoising forward for
    one rank's (``rollout_sp``); the text encoder's forward and the VAE decode stay whole; refused without Ulysses,
    outside the hybrid layout and unmeasured."""
    plan = _fake_plan()
    entry = plan["resolutions"]["512"]
    entry["rollout_gb"]["cfg"] = 3.0  # the denoising forward is the rollout's largest
    entry["train_sp"] = {"2": {key: {**t, "peak_gb": 0.6} for key, t in entry["train"].items()}}
    entry["rollout_sp"] = {"2": {"cfg": 1.4}}
    alone = ml.device_peak(plan, 512, True, True, False, ranks=2, sp=2)
    split = ml.device_peak(plan, 512, True, True, False, ranks=2, sp=2, split_generation=True)
    assert alone["rollout_gb"] - split["rollout_gb"] == pytest.approx(3.0 - 1.4)
    assert split["update_gb"] == alone["update_gb"]
    entry["rollout_sp"]["2"]["cfg"] = 0.05  # below the (video: tiled) VAE decode's 0.2, which is then the floor
    assert ml.device_peak(plan, 512, True, True, False, ranks=2, sp=2, split_generation=True)["rollout_gb"] == (
        pytest.approx(alone["rollout_gb"] - 3.0 + 0.2)
    )
    assert ml.layout_rows(plan)["hybrid LoRA sp2, generation split"]["512"]["rollout_gb"] < alone["rollout_gb"]
    for kw, match in (({"sp": 1}, "only a hybrid Ulysses group"), ({"layout": "trainer"}, "only a hybrid")):
        with pytest.raises(ValueError, match=match):
            ml.device_peak(plan, 512, True, True, False, **{"ranks": 2, "sp": 2, "split_generation": True, **kw})
    with pytest.raises(ValueError, match="no_cfg generation at 512.*--sp"):
        ml.device_peak(plan, 512, False, True, False, ranks=2, sp=2, split_generation=True)


def test_live_memory_counts_allocations_not_views():
    import torch

    x = torch.empty(1000, 1000, device="meta")
    with mp.LiveMemory() as mem:
        y = x * 2  # 4 MB new
        _ = y.t()  # view: nothing new
        y.add_(1)  # in place: nothing new
        z = y + 1  # 4 MB new
        del y, z, _
    assert mem.peak == 8_000_000 and mem.current == 0


def test_cli_writes_json(tmp_path, monkeypatch, capsys):
    """The command line end to end on a cheap setting (the VAE-free path is shared with the plan above)."""
    calls = []
    monkeypatch.setattr(mp, "plan_model", lambda model, *args, sp: calls.append((model, sp)) or _fake_plan())
    out = tmp_path / "plan.json"
    mp.main(["--model", "wan_1_3b", "--resolution", "512", "--output", str(out), "--sp", "2"])
    report = json.loads(out.read_text())
    plan = report["models"]["wan_1_3b"]
    assert calls == [("wan_1_3b", (2,))] and "H100 80GB" in plan["recommendations"]
    assert plan["layouts"]["rollout worker LoRA"]["512"]["update_gb"] == 0.0
    assert "wan_1_3b" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # sp=1 is the plan itself
        mp.main(["--model", "wan_1_3b", "--sp", "1", "--output", str(out)])
    assert "Ulysses degrees are >= 2" in capsys.readouterr().err


def _fake_plan():
    train = {"held_gb": 1.0, "saved_gb": 1.0, "peak_gb": 1.5}
    return {
        "source": "test",
        "frames": 33,
        "text_tokens": 512,
        "micro_batch": 1,
        "rollout_batch": 8,
        "weights": {p: {"params": 1, "gb": 1.0} for p in ("transformer", "text_encoder", "vae")},
        "lora": {"rank": 64, "params": 1, "gb": 0.1},
        "text_encoder_forward_gb": 0.1,
        "optimizer_step_gb": 0.1,
        "lora_allreduce_bucket_gb": 0.01,
        "resolutions": {
            "512": {
                "train": {f"{c}/{k}": train for c in ("no_cfg", "cfg") for k in ("no_ckpt", "ckpt")},
                "rollout_gb": {"cfg": 0.2, "no_cfg": 0.1},
                "vae_decode_gb": {"plain": 0.5, "tiled": 0.2},
            }
        },
    }
