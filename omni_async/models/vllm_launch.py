"""Starting a vLLM OpenAI-compatible server from its own environment, shared by the text rollout
(``models.vllm_text_policy``) and the judge servers (``reward.vllm_server``). Nothing here imports vLLM.

Logging: a server that became healthy is INFO (its URL, model, devices and start-up time)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from typing import Any

import httpx

logger = logging.getLogger(__name__)

# vLLM's MaxLoRARanks (vllm/config/lora.py); older releases accept a subset (<= 0.6: 8..64, later up to 256).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int, config_key: str) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds an adapter of ``rank`` (48 -> 64)."""
    rank = int(rank)
    for allowed in VLLM_MAX_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(
        f"{config_key}={rank}: vLLM serves LoRA ranks up to {VLLM_MAX_LORA_RANKS[-1]} "
        f"(--max-lora-rank is one of {VLLM_MAX_LORA_RANKS}). Fix: use a rank <= {VLLM_MAX_LORA_RANKS[-1]}"
    )


def normalize_server_args(args: list[Any], config_key: str, min_lora_rank: int | None = None) -> list[str]:
    """``args`` as strings with any ``--max-lora-rank N`` / ``--max-lora-rank=N`` rounded up to an allowed value;
    with ``min_lora_rank``, a value below it (the adapter would be refused at every sync) is an error."""
    out = [str(a) for a in args]
    for i, arg in enumerate(out):
        if arg == "--max-lora-rank" and i + 1 < len(out):
            at, value = i + 1, out[i + 1]
        elif arg.startswith("--max-lora-rank="):
            at, value = i, arg.split("=", 1)[1]
        else:
            continue
        try:
            rank = vllm_max_lora_rank(int(value), f"{config_key} --max-lora-rank")
        except ValueError as e:
            raise ValueError(f"{config_key}: --max-lora-rank {value!r} is not a valid rank ({e})") from None
        if min_lora_rank is not None and rank < int(min_lora_rank):
            raise ValueError(
                f"{config_key}: --max-lora-rank {value} is below the LoRA rank {min_lora_rank}, so vLLM "
                "would refuse every adapter. Fix: drop --max-lora-rank from server_args (it is set "
                "from actor_rollout_ref.model.lora_rank)"
            )
        out[at] = str(rank) if at != i else f"--max-lora-rank={rank}"
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def start_vllm(
    cmd: list[str], url: str, config_key: str, env: dict[str, str] | None = None, startup_timeout_s: float = 900.0
) -> subprocess.Popen:
    """Check that ``cmd[0]`` (the configured python) has vLLM, start the server, wait until ``/health`` is OK."""
    check = subprocess.run([cmd[0], "-c", "import vllm"], capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(
            f"{config_key}={cmd[0]} cannot import vllm "
            f"({check.stderr.strip().splitlines()[-1] if check.stderr.strip() else 'no error text'}). Fix: "
            "install vLLM into its own environment and point server_python at that environment's python"
        )
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})})
    t0 = time.time()
    deadline = t0 + startup_timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server ({config_key}) exited with code {proc.returncode} during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                logger.info(
                    "vLLM server (%s) healthy at %s after %.0fs: model %s, CUDA_VISIBLE_DEVICES=%s, pid %d",
                    config_key,
                    url,
                    time.time() - t0,
                    cmd[cmd.index("--model") + 1] if "--model" in cmd else "?",
                    (env or {}).get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "")),
                    proc.pid,
                )
                return proc
        except httpx.HTTPError:
            time.sleep(2)
    proc.kill()
    raise RuntimeError(f"vLLM server ({config_key}) not healthy after {startup_timeout_s:g}s")
