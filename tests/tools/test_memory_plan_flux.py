"""The memory plan covers FLUX.1-dev (``flux_1_dev``): its two text encoders are both resident and the larger forward
counts, and the recipe's row is planned without CFG (the guidance-distilled transformer runs one branch)."""

from __future__ import annotations

import pytest

mp = pytest.importorskip("omni_async.tools.memory_plan")
ml = pytest.importorskip("omni_async.tools.memory_layouts")


def fake_plan(cfg: bool) -> dict:
    train = {"held_gb": 1.0, "saved_gb": 1.0, "peak_gb": 2.0}
    return {
        "frames": 1,
        "cfg": cfg,
        "micro_batch": 1,
        "weights": {p: {"params": 1, "gb": gb} for p, gb in (("transformer", 24.0), ("text_encoder", 0.25),
                                                                ("text_encoder_2", 9.5), ("vae", 0.2))},
        "lora": {"rank": 64, "params": 1, "gb": 0.0},
        "text_encoder_forward_gb": 1.5,
        "optimizer_step_gb": 0.1,
        "lora_allreduce_bucket_gb": 0.01,
        "resolutions": {
            "512": {
                "train": {"no_cfg/ckpt": train, "cfg/ckpt": {**train, "peak_gb": 4.0}},
                "rollout_gb": {"cfg": 3.0, "no_cfg": 1.0},
                "vae_decode_gb": {"plain": 0.5, "tiled": 0.2},
            }
        },
    }  # fmt: skip


def test_both_text_encoders_are_resident_and_the_row_has_no_cfg():
    plan = fake_plan(cfg=False)
    peak = ml.device_peak(plan, 512, False, True, False, snapshot=False)
    assert peak["rollout_gb"] == pytest.approx(24.0 + 0.25 + 9.5 + 0.2 + 1.5)  # the encoders' forward is the largest
    offloaded = ml.device_peak(plan, 512, False, True, True, snapshot=False)
    assert peak["update_gb"] - offloaded["update_gb"] == pytest.approx(0.25 + 9.5 + 0.2)  # param_offload moves all
    rows = ml.layout_rows(plan)
    assert rows["hybrid LoRA"]["512"]["update_gb"] == pytest.approx(24.0 + 9.95 + 2.0)  # no_cfg's training peak
    assert ml.layout_rows(fake_plan(cfg=True))["hybrid LoRA"]["512"]["update_gb"] == pytest.approx(24.0 + 9.95 + 4.0)


@pytest.mark.slow  # the real 57-block transformer and T5-XXL on meta
def test_flux_1_dev_is_planned_on_its_real_architecture():
    """Weights of every component (the 11.9 B transformer, CLIP-L and T5-XXL, the VAE), T5's forward at 512 tokens
    as the text encoders' (CLIP reads its 77). The plan's FLUX transformer inputs ran in ``--model flux_1_dev``
    (bench/results/memory_plan.json): a forward of the 57 blocks here would cost the suite ~10 s more."""
    assert mp.text_encoders("flux_1_dev") == ["text_encoder", "text_encoder_2"]
    counts = {part: mp.nbytes(mp.component("flux_1_dev", part))[0] for part in ("transformer", "text_encoder_2")}
    assert abs(counts["transformer"] / 11.9e9 - 1) < 0.01 and abs(counts["text_encoder_2"] / 4.76e9 - 1) < 0.01
    t5 = mp._measure_one_encoder("flux_1_dev", "text_encoder_2", 1)  # noqa: SLF001
    assert mp.measure_text_encoder("flux_1_dev", 1) == t5 > mp._measure_one_encoder("flux_1_dev", "text_encoder", 1)  # noqa: SLF001
