"""Helpers for the scorer-server tests: real servers on loopback, one process each, and image encoders."""

from __future__ import annotations

import base64
import io
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image, ImageDraw, ImageFont

LISTENING = re.compile(r"http_scorer listening on (http://\S+)")


def launch(cmd: list, timeout_s: float = 60.0, **popen: object) -> tuple[subprocess.Popen, str, list[str]]:
    """Start a scorer server ``cmd`` (``serve --port 0 ...``) and return it with the URL it reports once its port is
    bound (no free-port guess that another process could take first) and its output so far. A thread keeps reading
    the output (into the returned list), so a chatty server never blocks on a full pipe."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
    output: list[str] = []
    urls: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            output.append(line)
            if m := LISTENING.search(line):
                urls.put(m.group(1))
        urls.put(None)  # end of output: the process is gone

    threading.Thread(target=read, daemon=True).start()
    try:
        url = urls.get(timeout=timeout_s)
    except queue.Empty:
        proc.kill()
        raise RuntimeError(f"server reported no port within {timeout_s:g}s: {''.join(output)}") from None
    if url is None:
        raise RuntimeError(f"server exited (code {proc.wait()}): {''.join(output)}")
    return proc, url, output


def wait_healthy(proc: subprocess.Popen, url: str, output: list[str], timeout_s: float = 60.0) -> None:
    """Until ``/health`` answers 200 (the port is bound before the app has started)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited (code {proc.returncode}): {''.join(output)}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"server did not come up: {''.join(output)}")


class Server:
    def __init__(self, *args: str):
        # This directory is importable in the server, so `--scorer scorer_server_helpers:hold_scorer` works.
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])),
        }
        self.proc, self.url, self.output = launch(
            [sys.executable, "-m", "http_scorer", "serve", "--port", "0", *args], env=env
        )
        self.port = int(self.url.rsplit(":", 1)[1])
        wait_healthy(self.proc, self.url, self.output)

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
