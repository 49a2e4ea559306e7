"""Soak: real stream-mode training whose reward is an HTTP scorer behind a faulty network, with workers killed.

    .venv/bin/python bench/soak.py [--steps 8] [--out bench/results/soak.json]

Each step trains the tiny model (tiny:sd3, 32x32, 4 denoising steps; 2 prompts x 4 samples, the SMALL config of
tests/test_reliability.py) in stream mode on real Ray actors. The reward is the HTTP scorer client
(``pkg://omni_async.reward.scorers.http``) against a real loopback scorer server (``python -m http_scorer serve
--scorer jpeg``) reached only through ``bench/fault_proxy.py``, which answers 503 (``Retry-After: 1``) to 30% of
requests, hangs on 5% (15 s, longer than the client's 3 s timeout) and resets the connection (TCP RST) on 1%.
On top of that, from a side thread:

- step ``--kill-reward-step``: ``ray.kill(trainer.reward.workers[0], no_restart=False)`` once that worker has a
  sample in flight (the dispatcher re-sends it: ``reward/retried``);
- step ``--kill-rollout-step``: ``ray.kill(trainer.placement.rollout_workers[0], no_restart=False)`` once the
  replica has finished its first device batch of the step, the rest still generating (``rollout/regenerated``).

Accounting, per step and in total: ``expected`` = train_batch_size x n; ``produced`` = samples the step returned;
``trained`` = sum of ``loss_mask`` over the mini-batches the optimizer was given (recorded by wrapping
``StepOps.optimizer_step``; ppo_epochs = 1); ``failed`` = masked samples (no reward, or a group with < 2 rewarded
members); ``rows`` = mini-batch rows (every produced sample must appear exactly once); ``lost`` = expected -
trained - failed (must be 0), ``duplicated`` = rows - produced (must be 0).

Why no sample is lost with these fault rates (client ``reward_kwargs``): an attempt fails with p = 0.36
(503 + hang + reset); ``max_retries=10`` gives 11 attempts, so a call exhausts its retries with p = 0.36^11
= 1.3e-5. The slowest possible call (11 attempts each timing out at 3 s, backoffs capped at 0.2 * 2^k and 5 s, a
503's Retry-After capped at 2 s) takes 33 + 31.2 = 64 s, below ``reward.timeout_s`` = 120 s, so no call is cut
off by the reward worker's deadline either.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omni_async.reward.pixels import to_pixels  # noqa: E402
from omni_async.reward.scorers.http import HttpScorer  # noqa: E402

SMALL = [
    "actor_rollout_ref.model.path=tiny:sd3",
    "actor_rollout_ref.model.lora_rank=8",  # LoRA r8/alpha16 (the config's default is a full fine-tune, rank 0)
    "actor_rollout_ref.model.lora_alpha=16",
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    "actor_rollout_ref.rollout.num_inference_steps=4",
    "actor_rollout_ref.rollout.height=32",
    "actor_rollout_ref.rollout.width=32",
    "actor_rollout_ref.rollout.algo.sde_window_range=[0,3]",
    "actor_rollout_ref.rollout.agent.max_batch_size=2",
    "trainer.logger=[jsonl]",
    "trainer.resume_mode=disable",
    "data.shuffle=false",
    "reward.streaming=true",
]

COUNTERS = ("reward/http_retries", "reward/http_timeouts", "reward/retried", "rollout/regenerated")


class PixelsHttpScorer(HttpScorer):
    """``HttpScorer`` handed ``(H, W, 3)`` pixels. Used only while the client cannot encode verl-omni's ``(C, H, W)``
    uint8 tensor (what reward functions receive since the restructure: ``_image_json`` calls ``np.asarray`` +
    ``Image.fromarray`` on it, a TypeError); a no-op wrapper once the client converts with ``to_pixels`` itself."""

    async def compute_score(self, data_source, solution_image, ground_truth=None, extra_info=None, **kwargs):
        return await super().compute_score(data_source, to_pixels(solution_image), ground_truth, extra_info, **kwargs)


def client_encodes_chw() -> bool:
    """Whether ``HttpScorer`` itself accepts the ``(C, H, W)`` tensor the reward manager passes."""
    import torch

    try:
        HttpScorer("http://127.0.0.1:9")._image_json(torch.zeros(3, 8, 8, dtype=torch.uint8))
        return True
    except TypeError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], health: str, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(health, timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.terminate()
    raise RuntimeError(f"{cmd[:4]} did not come up: {log.read_text()[-2000:]}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


class Killer(threading.Thread):
    """Waits (polling) for the moment a worker has work in flight in this step, then kills it with a restart."""

    def __init__(self, what: str, trainer, timeout_s: float = 120.0):
        super().__init__(daemon=True)
        self.what, self.trainer, self.timeout_s = what, trainer, timeout_s
        self.report: dict = {"what": what, "killed": False}
        self.stop_event = threading.Event()
        if what == "rollout":
            import ray

            self.replica = trainer.placement.rollout_workers[0]
            self.batches_before = len(ray.get(self.replica.stats.remote())["batch_sizes"])

    def run(self) -> None:
        import ray

        t0, deadline = time.perf_counter(), time.perf_counter() + self.timeout_s
        while not self.stop_event.is_set() and time.perf_counter() < deadline:
            if self.what == "reward":
                inflight = self.trainer.agent.dispatcher.inflight[0]
                if inflight >= 1:
                    ray.kill(self.trainer.reward.workers[0], no_restart=False)
                    self.report.update(killed=True, at_s=time.perf_counter() - t0, inflight_on_worker=inflight)
                    return
                time.sleep(0.01)
            else:
                stats = ray.get(self.replica.stats.remote())
                done = len(stats["batch_sizes"]) - self.batches_before
                if done >= 1:
                    ray.kill(self.replica, no_restart=False)  # the rest of the step's batches still in flight
                    self.report.update(killed=True, at_s=time.perf_counter() - t0, batches_done=done, pid=stats["pid"])
                    return
                time.sleep(0.02)


def machine() -> dict:
    import ray
    import torch

    cpu = platform.processor()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = next((int(ln.split()[1]) // 1024 for ln in open("/proc/meminfo") if ln.startswith("MemTotal")), None)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_mb": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "note": "loopback only; cores shared with other jobs",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--kill-reward-step", type=int, default=2, help="1-based step in which reward worker 0 dies")
    p.add_argument("--kill-rollout-step", type=int, default=5, help="1-based step in which rollout worker 0 dies")
    p.add_argument("--reward-workers", type=int, default=2)
    p.add_argument("--scorer", default="jpeg")
    p.add_argument("--p-503", type=float, default=0.30)
    p.add_argument("--p-hang", type=float, default=0.05)
    p.add_argument("--p-reset", type=float, default=0.01)
    p.add_argument("--hang-s", type=float, default=15.0)
    p.add_argument("--retry-after", type=int, default=1)
    p.add_argument("--client-timeout-s", type=float, default=3.0)
    p.add_argument("--max-retries", type=int, default=10)
    p.add_argument("--backoff-s", type=float, default=0.2)
    p.add_argument("--max-retry-after-s", type=float, default=2.0)
    p.add_argument("--reward-timeout-s", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/soak.json")
    args = p.parse_args()

    from omni_async.cluster import shutdown_ray
    from omni_async.trainer.config import compose
    from omni_async.trainer.loop import RLTrainer

    reward_kwargs = {
        "timeout_s": args.client_timeout_s,
        "max_retries": args.max_retries,
        "backoff_s": args.backoff_s,
        "max_retry_after_s": args.max_retry_after_s,
    }
    t_wall = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server_port, proxy_port = free_port(), free_port()
        server = start(
            [
                sys.executable,
                "-m",
                "http_scorer",
                "serve",
                "--scorer",
                args.scorer,
                "--host",
                "127.0.0.1",
                "--port",
                str(server_port),
            ],
            f"http://127.0.0.1:{server_port}/health",
            tmp / "server.log",
        )
        proxy = start(
            [
                sys.executable,
                str(ROOT / "bench/fault_proxy.py"),
                "--upstream",
                f"http://127.0.0.1:{server_port}",
                "--port",
                str(proxy_port),
                "--p-503",
                str(args.p_503),
                "--p-hang",
                str(args.p_hang),
                "--p-reset",
                str(args.p_reset),
                "--hang-s",
                str(args.hang_s),
                "--retry-after",
                str(args.retry_after),
                "--seed",
                str(args.seed),
            ],
            f"http://127.0.0.1:{proxy_port}/__proxy_stats",
            tmp / "proxy.log",
        )
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        rows = [{"prompt": f"p{i}", "data_source": "soak", "reward_model": {"ground_truth": ""}} for i in range(16)]
        (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        # The client as shipped when it can encode what it is given; else the same class behind a to_pixels shim.
        fixed = client_encodes_chw()
        reward_fn = (
            [
                "reward.custom_reward_function.path=pkg://omni_async.reward.scorers.http",
                "reward.custom_reward_function.name=HttpScorer",
            ]
            if fixed
            else [
                f"reward.custom_reward_function.path={ROOT / 'bench/soak.py'}",
                "reward.custom_reward_function.name=PixelsHttpScorer",
            ]
        )
        # The rollout worker it kills is a replica Ray restarts: the split layout (hybrid: an actor rank, fatal).
        overrides = [
            *SMALL,
            "actor_rollout_ref.hybrid_engine=false",
            f"data.train_files={tmp}/train.jsonl",
            f"trainer.run_dir={tmp}/run",
            f"trainer.total_training_steps={args.steps}",
            f"trainer.seed={args.seed}",
            f"reward.num_workers={args.reward_workers}",
            f"reward.timeout_s={args.reward_timeout_s}",
            *reward_fn,
            f"+reward.custom_reward_function.reward_kwargs.server_url={proxy_url}",
            *(f"+reward.custom_reward_function.reward_kwargs.{k}={v}" for k, v in reward_kwargs.items()),
        ]
        shutdown_ray()
        trainer = RLTrainer(compose(overrides))
        cfg = trainer.cfg
        expected = int(cfg.data.train_batch_size) * int(cfg.actor_rollout_ref.rollout.n)
        seen = {"rows": 0, "trained": 0}
        real_step = trainer.ops.optimizer_step

        def recording_step(minibatch, timer):
            mask = minibatch.batch["loss_mask"]
            seen["rows"] += int(mask.numel())
            seen["trained"] += int(mask.bool().sum())
            return real_step(minibatch, timer)

        trainer.ops.optimizer_step = recording_step
        per_step, kills = [], []
        try:
            trainer.sync_weights(0)
            for step in range(args.steps):
                seen.update(rows=0, trained=0)
                before = httpx.get(f"{proxy_url}/__proxy_stats").json()
                killer = None
                if step + 1 in (args.kill_reward_step, args.kill_rollout_step):
                    killer = Killer("reward" if step + 1 == args.kill_reward_step else "rollout", trainer)
                    killer.start()
                metrics, samples = trainer.train_step(step)
                if killer is not None:
                    killer.stop_event.set()
                    killer.join()
                    kills.append({"step": step + 1, **killer.report})
                after = httpx.get(f"{proxy_url}/__proxy_stats").json()
                indices = [s.index for s in samples]
                failed = int(metrics["reward/masked"])
                row = {
                    "step": step + 1,
                    "expected": expected,
                    "produced": len(samples),
                    "with_outcome": sum(s.outcome is not None for s in samples),
                    "unique": len(set(indices)),
                    "rows": seen["rows"],
                    "trained": seen["trained"],
                    "failed": failed,
                    "no_reward": int(metrics["reward/failed"] + metrics["reward/timed_out"]),
                    "lost": expected - seen["trained"] - failed,
                    "duplicated": seen["rows"] - len(samples),
                    **{k: int(metrics.get(k, 0)) for k in COUNTERS},
                    "proxy": {k: after[k] - before[k] for k in after},
                    "step_s": metrics["timing_s/step"],
                    "reward_mean": metrics["critic/rewards/mean"],
                    "kill": killer.report if killer is not None else None,
                }
                per_step.append(row)
                print(
                    f"step {step + 1}: {row['step_s']:.1f}s produced {row['produced']} trained {row['trained']} "
                    f"failed {failed} lost {row['lost']} | http_retries {row['reward/http_retries']} "
                    f"http_timeouts {row['reward/http_timeouts']} retried {row['reward/retried']} "
                    f"regenerated {row['rollout/regenerated']} | proxy {row['proxy']}"
                    + (f" | killed {killer.report}" if killer else ""),
                    flush=True,
                )
        finally:
            trainer.close()
            shutdown_ray()
            proxy_counts = httpx.get(f"{proxy_url}/__proxy_stats").json()
            stop(proxy)
            stop(server)

    step_s = [r["step_s"] for r in per_step]
    total_keys = ("expected", "produced", "trained", "failed", "no_reward", "lost", "duplicated", *COUNTERS)
    totals = {k: sum(r[k] for r in per_step) for k in total_keys}
    totals.update(
        step_s_p50=float(np.percentile(step_s, 50)),
        step_s_p95=float(np.percentile(step_s, 95)),
        step_s_mean=float(np.mean(step_s)),
        wall_s=time.time() - t_wall,
    )
    report = {
        "totals": totals,
        "proxy": proxy_counts,
        "kills": kills,
        "steps": per_step,
        "config": {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "overrides": [
                o.replace(str(ROOT) + "/", "") for o in overrides if "run_dir" not in o and "train_files" not in o
            ],
            "reward_kwargs": reward_kwargs,
            "reward_function": [o.replace(str(ROOT) + "/", "") for o in reward_fn],
            "client_shim": None if fixed else "PixelsHttpScorer: HttpScorer cannot encode (C, H, W) tensors",
            "mode": "stream (reward.streaming=true, on-policy, full batch)",
            "step_time": "timing_s/step of every step, kill steps and the first (warm-up) included",
        },
        "machine": machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(
        f"\ntotal over {args.steps} steps: expected {totals['expected']} produced {totals['produced']} "
        f"trained {totals['trained']} failed {totals['failed']} LOST {totals['lost']} "
        f"duplicated {totals['duplicated']}"
    )
    print("  " + " ".join(f"{k} {totals[k]}" for k in COUNTERS))
    print(f"  step time p50 {totals['step_s_p50']:.2f}s p95 {totals['step_s_p95']:.2f}s")
    print(f"  proxy: {proxy_counts}")
    print(f"  kills: {kills}")
    print(f"written: {args.out}")
    if totals["lost"] or totals["duplicated"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
