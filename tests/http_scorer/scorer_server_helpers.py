"""Helpers for the scorer-server tests: real servers on loopback, one process each, and image encoders."""

from __future__ import annotations

import base64
import io
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image, ImageDraw, ImageFont


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # This directory is importable in the server, so `--scorer scorer_server_helpers:hold_scorer` works.
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "http_scorer", "serve", "--port", str(self.port), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("server did not come up")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)

    def pids(self) -> list[int]:
        """The server process and its scorer processes (its children, recursively)."""
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    todo += [int(c) for c in (task / "children").read_text().split()]
                except OSError:
                    pass
        return out

    def memory_mb(self, key: str = "VmRSS") -> float:
        """Resident memory of the server's processes together, now (``VmRSS``) or the sum of their peaks so far
        (``VmHWM``: at least the peak of the sum), in MB."""
        total = 0.0
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/status") as f:
                    total += next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024
            except (OSError, StopIteration):
                pass
        return total


def hold_scorer(images, prompts, ground_truths, metadata):
    """A scorer that holds its batch like a model call would (``metadata.hold_s``, default 0.3 s) and returns
    each image's height, so a test can see what size the scorer was given."""
    time.sleep(float(metadata.get("hold_s", 0.3)))
    return [{"score": float(img.shape[-3]), "shape": list(img.shape)} for img in images]


def pid_scorer(images, prompts, ground_truths, metadata):
    """Holds its batch ``metadata.hold_s`` (default 0) and says which scorer process scored each item and when the
    batch started and ended (``time.time()``: one clock for every process); with ``metadata.crash`` the process dies
    mid-batch, as a segfault in native code would."""
    if metadata.get("crash"):
        os._exit(7)
    start = time.time()
    time.sleep(float(metadata.get("hold_s", 0)))
    end = time.time()
    return [{"score": 1.0, "pid": os.getpid(), "batch": len(images), "start": start, "end": end} for _ in images]


def small_side_scorer(images, prompts, ground_truths, metadata):
    return hold_scorer(images, prompts, ground_truths, {"hold_s": 0})


small_side_scorer.max_side = 256


def encode(img: np.ndarray | Image.Image, fmt: str = "png") -> bytes:
    buf = io.BytesIO()
    (img if isinstance(img, Image.Image) else Image.fromarray(img)).save(buf, format=fmt.upper())
    return buf.getvalue()


def b64(img, fmt: str = "png") -> dict:
    return {"data": base64.b64encode(encode(img, fmt)).decode(), "format": fmt}


def text_image(text: str, size=(256, 96)) -> np.ndarray:
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).text((16, 24), text, fill="black", font=ImageFont.load_default(size=40))
    return np.asarray(img)


BLANK = np.full((96, 256, 3), 255, np.uint8)
