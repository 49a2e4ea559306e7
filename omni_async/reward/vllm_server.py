"""vLLM judge servers on the reward pool (GPU clusters).

With ``reward.reward_model.enable=True`` and ``reward.reward_model.rollout.name=vllm`` the reward pool's devices
(``n_gpus_per_node x nnodes``) are reserved as one Ray placement group of ``tensor_model_parallel_size``-device
bundles (verl's pool bundles are single devices, too small for a TP server); one OpenAI-compatible vLLM server
runs per bundle inside a Ray actor that holds those devices, and the VLM judge (``backend=openai``) spreads its
requests over their URLs least-loaded.

vLLM cannot be installed next to verl 0.9.1, so the server runs from its own environment:
``reward.reward_model.rollout.server_python`` is that environment's python (the command is
``<server_python> -m vllm.entrypoints.openai.api_server --model ... --tensor-parallel-size ...`` plus
``server_args``; ``enforce_eager=True`` adds ``--enforce-eager``). Nothing here imports vLLM. A judge owns its
reward-pool devices, so its KV cache stays resident between steps: verl's ``free_cache_engine`` has no effect on such
a (standalone) server, there as here (``omni_async.config.upstream_keys``).

The judge servers serve the base model (no LoRA). ``--max-lora-rank`` accepts only :data:`VLLM_MAX_LORA_RANKS`
(vLLM's ``MaxLoRARanks``, ``vllm/config/lora.py``; any other value stops the server at argument parsing): a value
given in ``server_args`` here or in the text rollout's is rounded up to the next allowed one
(:func:`normalize_server_args`), as the rollout's own ``--max-lora-rank`` is (:func:`vllm_max_lora_rank`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_async.models.vllm_launch import (  # noqa: F401 (re-exported for callers)
    VLLM_MAX_LORA_RANKS,
    free_port,
    normalize_server_args,
    start_vllm,
    vllm_max_lora_rank,
)

SERVED_MODEL_NAME = "judge"


def server_command(rollout_cfg: dict[str, Any], model_path: str, port: int) -> list[str]:
    return [
        str(rollout_cfg["server_python"]),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_path),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--tensor-parallel-size",
        str(rollout_cfg["tensor_model_parallel_size"]),
        "--gpu-memory-utilization",
        str(rollout_cfg["gpu_memory_utilization"]),
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
        *(["--enforce-eager"] if rollout_cfg.get("enforce_eager") else []),  # no CUDA graphs
        *(["--max-model-len", str(rollout_cfg["max_model_len"])] if rollout_cfg.get("max_model_len") else []),
        *(["--max-num-seqs", str(rollout_cfg["max_num_seqs"])] if rollout_cfg.get("max_num_seqs") else []),
        *normalize_server_args(rollout_cfg.get("server_args") or [], "reward.reward_model.rollout.server_args"),
    ]


class VLLMServer:
    """Ray actor: owns one vLLM judge server process on the devices Ray gave it."""

    def __init__(self, rollout_cfg: dict[str, Any], model_path: str, startup_timeout_s: float = 900.0):
        import ray

        from omni_async.cluster import resume_gc
        from omni_async.logs import setup_logging

        setup_logging()  # idempotent (the process setup hook normally did it); start_vllm logs the server's start
        self.port, self.host = free_port(), ray.util.get_node_ip_address()
        self.proc = start_vllm(
            server_command(rollout_cfg, model_path, self.port),
            self.url(),
            "reward.reward_model.rollout.server_python",
            {"CUDA_VISIBLE_DEVICES": ",".join(str(int(g)) for g in ray.get_gpu_ids())},
            startup_timeout_s,
        )
        resume_gc()  # this process's imports are done (cluster.pause_gc_while_importing)

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout_s: float = 30.0) -> None:
        """Terminate the server and wait until it has exited (killed after ``timeout_s``), so its port and devices
        are free when this returns."""
        import subprocess

        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def judge_placement_group(reward_cfg, timeout_s: float = 600.0):
    """The reward pool for vLLM judges: ``n_gpus_per_node / TP x nnodes`` bundles of TP devices (+1 CPU)."""
    import ray
    from ray.util.placement_group import placement_group

    rm = reward_cfg.reward_model
    tp = int(rm.rollout.tensor_model_parallel_size)
    replicas = int(rm.n_gpus_per_node) // tp * int(rm.nnodes)
    pg = placement_group([{"GPU": tp, "CPU": 1}] * replicas, strategy="PACK", name="reward_judges")
    ray.get(pg.ready(), timeout=timeout_s)
    return pg


@dataclass
class JudgeServers:
    """The running judge servers: their Ray actors and base URLs. Ray ends an actor once no handle to it is left
    (and the vLLM process with it), so whoever uses the URLs keeps this object for as long as it does."""

    actors: list[Any]
    urls: list[str]

    def stop(self) -> None:
        """Stop the vLLM processes and end the actors."""
        import ray

        ray.get([a.stop.remote() for a in self.actors])
        for a in self.actors:
            ray.kill(a)
        self.actors = []


def launch_judge_servers(reward_cfg, pg) -> JudgeServers:
    """One vLLM server per bundle of ``pg``, returned once all are healthy (keep the result: see
    :class:`JudgeServers`)."""
    import ray
    from omegaconf import OmegaConf
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    rm = reward_cfg.reward_model
    rollout = OmegaConf.to_container(rm.rollout, resolve=True)
    tp = int(rollout["tensor_model_parallel_size"])
    cls = ray.remote(VLLMServer)
    servers = [
        cls.options(
            num_gpus=tp,
            num_cpus=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i),
        ).remote(rollout, rm.model_path)
        for i in range(pg.bundle_count)
    ]
    return JudgeServers(servers, ray.get([s.url.remote() for s in servers]))
