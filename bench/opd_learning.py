"""DiffusionOPD learning on the main job's renderer (issue 54 item 5, recorded, not asserted).

Two steps, run by hand (``docs/losses.md`` has the result):

1. ``teacher``: merge a Flow-GRPO run's LoRA checkpoint of the main job (``examples/run_qwen_image_ocr_async_reward.sh``)
   into the renderer's transformer and save the whole pipeline: a teacher of the student's family (same text
   encoder, VAE and scheduler) that draws legibly more often than the base renderer.
2. ``summary``: after a distillation run of the base renderer toward it (the main job with
   ``actor_rollout_ref.actor.diffusion_loss.loss_mode=distill_kl distillation.enabled=true
   distillation.teacher_models.teacher_model.model_path=<dir>``), the per-step teacher agreement
   (``actor/distill_kl_loss``) and OCR reward (monitored only) of its ``metrics.jsonl``, as JSON.

    python bench/opd_learning.py teacher --run <flow_grpo run dir> --step 12 --out <teacher dir>
    python bench/opd_learning.py summary --run <distill run dir> --teacher-run <flow_grpo run dir> --out <json> \\
        --plot <png>
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

torch.set_num_threads(1)


def make_teacher(run: Path, step: int, out: Path) -> None:
    """The run's base pipeline with its LoRA (``checkpoints/step_<step>/actor.pt``) merged into the transformer."""
    from omegaconf import OmegaConf
    from peft.tuners.lora import LoraLayer

    from omni_async.models.diffusion_policy import DiffusionPolicy, SamplingConfig
    from omni_async.models.tiny import resolve_model_path

    m = OmegaConf.load(run / "config.yaml").actor_rollout_ref.model
    policy = DiffusionPolicy(
        m.path, SamplingConfig(), lora_rank=m.lora_rank, lora_alpha=m.lora_alpha, target_modules=list(m.target_modules)
    )
    state = torch.load(run / f"checkpoints/step_{step:06d}/actor.pt", weights_only=True)
    policy.load_weights_state_dict(state["weights"])
    merged = {}
    for name, module in policy.transformer.named_modules():
        if isinstance(module, LoraLayer):
            module.merge()
            merged[f"{name}.weight"] = module.get_base_layer().weight.detach().clone()
    base = Path(resolve_model_path(m.path))
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(base, out, ignore=shutil.ignore_patterns(".complete"))
    from diffusers import QwenImageTransformer2DModel

    transformer = QwenImageTransformer2DModel.from_pretrained(base / "transformer")
    missing = set(merged) - set(transformer.state_dict())
    assert not missing, sorted(missing)[:3]
    transformer.load_state_dict({**transformer.state_dict(), **merged})
    transformer.save_pretrained(out / "transformer")
    print(f"teacher: {len(merged)} merged LoRA sites from {run} step {step} -> {out}")


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summary(run: Path, teacher_run: Path | None, out: Path, plot: Path | None = None) -> None:
    train = [r for r in rows(run) if "actor/distill_kl_loss" in r]
    record = {
        "run": str(run),
        "steps": [r["step"] for r in train],
        "distill_kl_loss": [r["actor/distill_kl_loss"] for r in train],
        "reward_mean": [r.get("critic/rewards/mean") for r in train],
        "step_s": [r.get("timing_s/step") for r in train],
    }
    if teacher_run is not None:
        t = [r for r in rows(teacher_run) if "critic/rewards/mean" in r]
        record["teacher_run_reward_mean"] = [r["critic/rewards/mean"] for r in t]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    kl, rew = record["distill_kl_loss"], record["reward_mean"]
    print(f"distill_kl first 3 {sum(kl[:3]) / 3:.4g}, last 3 {sum(kl[-3:]) / 3:.4g}; ", end="")
    print(f"reward first 3 {sum(rew[:3]) / 3:.3f}, last 3 {sum(rew[-3:]) / 3:.3f} -> {out}")
    if plot is not None:
        draw(record, plot)


def draw(record: dict, path: Path) -> None:
    """Teacher agreement (distill_kl, log scale) and the monitored OCR reward per step, with the teacher's own run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    a.semilogy(record["steps"], record["distill_kl_loss"], marker=".")
    a.set(xlabel="step", ylabel="actor/distill_kl_loss", title="KL to the teacher (lower: closer)")
    b.plot(record["steps"], record["reward_mean"], marker=".", label="student (distill_kl)")
    if "teacher_run_reward_mean" in record:
        t = record["teacher_run_reward_mean"]
        b.plot(range(1, len(t) + 1), t, marker=".", label="teacher's Flow-GRPO run")
    b.set(xlabel="step", ylabel="OCR reward, rollout mean", title="reward (monitored, not trained)")
    b.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("teacher")
    t.add_argument("--run", type=Path, required=True)
    t.add_argument("--step", type=int, required=True)
    t.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("summary")
    s.add_argument("--run", type=Path, required=True)
    s.add_argument("--teacher-run", type=Path)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--plot", type=Path, help="also draw the two curves into this PNG")
    a = ap.parse_args()
    if a.cmd == "teacher":
        make_teacher(a.run, a.step, a.out)
    else:
        summary(a.run, a.teacher_run, a.out, a.plot)


if __name__ == "__main__":
    main()
