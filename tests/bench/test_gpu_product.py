"""bench/gpu_product.py reads a run's metrics into the GPU figures (GPU-s per trained image, peak memory per phase),
and the actor's per-phase peaks reduce as peaks (the largest, never a mean) across micro-batches and ranks."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from omni_async.trainer.data_parallel import merge_rank_metrics
from omni_async.trainer.device_memory import PhasePeaks
from omni_async.trainer.update import _step_metrics

ROOT = Path(__file__).resolve().parents[2]
# Loaded by path: bench/ on sys.path would let bench/http_scorer.py shadow the http_scorer package for every later
# test in the process.
_spec = importlib.util.spec_from_file_location("bench_gpu_product", ROOT / "bench/gpu_product.py")
gpu_product = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_product)


def test_gpu_seconds_per_image_and_peaks_per_phase(tmp_path):
    rows = [
        {
            "step": 1,
            "perf/throughput": 0.25,
            "perf/total_num_images": 8,
            "timing_s/step": 32.0,
            "perf/max_memory_allocated_gb/gen": 60.0,
            "perf/max_memory_allocated_gb/update": 64.5,
        },
        {
            "step": 2,
            "perf/throughput": 0.5,
            "perf/total_num_images": 8,
            "timing_s/step": 16.0,
            "timing_s/reward_wait": 0.5,
            "perf/max_memory_allocated_gb/gen": 61.0,
            "perf/max_memory_allocated_gb/update": 63.0,
        },
        {"step": 3, "perf/throughput": 1.0, "perf/total_num_images": 8, "timing_s/step": 8.0},
        {"step": 3, "val/ocr": 0.4},  # a validation row: not a training step
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = gpu_product.summarize(tmp_path)
    assert [s["gpu_s_per_image"] for s in report["steps"]] == [4.0, 2.0, 1.0]
    assert report["gpu_s_per_image_after_first"] == pytest.approx(1.5)  # the first step warms up
    assert report["peak_gib"] == {"gen": 61.0, "old_log_prob": 0.0, "update": 64.5}
    assert report["steps"][1]["time_s"] == {"step": 16.0, "reward_wait": 0.5}
    with pytest.raises(SystemExit, match="metrics.jsonl is missing"):
        gpu_product.summarize(tmp_path / "nowhere")


def test_peaks_reduce_to_the_largest_across_micro_batches_and_ranks():
    step = _step_metrics({"perf/max_memory_allocated_gb/update": [3.0, 7.0, 5.0], "actor/pg_loss": [1.0, 2.0, 3.0]})
    assert step == {"perf/max_memory_allocated_gb/update": 7.0, "actor/pg_loss": 2.0}
    ranks = merge_rank_metrics([{"perf/max_memory_allocated_gb": [2.0]}, {"perf/max_memory_allocated_gb": [9.0]}])
    assert ranks == {"perf/max_memory_allocated_gb": 9.0}
    cpu = PhasePeaks("cpu")  # no CUDA counter: nothing recorded, nothing reported
    with cpu.phase("update"):
        pass
    assert cpu.take() == {}
