"""Throughput and latency of the scorer server, on loopback, for the jpeg / sleep / ocr scorers.

    .venv/bin/python bench/http_scorer.py [--concurrency 32] [--requests 400] [--out bench/results/http_scorer.json]

For each scorer it starts ``python -m http_scorer serve`` on a free port, warms it up, then keeps
``--concurrency`` requests in flight (one 64x64 PNG each, protocol v1) until ``--requests`` are done, and reports
requests/s, p50/p99 latency and the mean scorer batch size read from the server's ``/metrics``.

    .venv/bin/python bench/http_scorer.py --memory [--out bench/results/http_scorer_memory.json]

instead floods a server at its default ``--max-inflight-pixels`` with 64 concurrent bomb-like requests (16 copies
of a ~50 kB 4000x4000 PNG each, a ~1 MB JSON body that decodes to 768 MB) while polling ``/health``, and reports
the responses by status, the server's peak RSS (``VmHWM``) and the slowest ``/health``. Two scorers: one that
downscales to 1024 px like ``ocr`` (``max_side``), and one that keeps full-size arrays (4 images per request).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image, ImageDraw, ImageFont

ROOT = Path(__file__).resolve().parents[1]


def png_b64(text: str) -> str:
    img = Image.new("RGB", (128, 64), "white")
    ImageDraw.Draw(img).text((8, 16), text, fill="black", font=ImageFont.load_default(size=24))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def ocr_sized_scorer(images, prompts, ground_truths, metadata):
    """Downscaled to 1024 px like the ocr scorer, 50 ms per batch, mean pixel value: the bench's stand-in for OCR."""
    time.sleep(0.05)
    return [float(img.mean()) for img in images]


ocr_sized_scorer.max_side = 1024


def full_size_scorer(images, prompts, ground_truths, metadata):
    """No ``max_side``: the scorer gets full-size arrays (the worst case for memory), 50 ms per batch."""
    time.sleep(0.05)
    return [float(img.shape[0]) for img in images]


def start(scorer: str, args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "http_scorer",
            "serve",
            "--scorer",
            scorer,
            "--port",
            str(port),
            "--max-batch",
            str(args.max_batch),
            "--max-wait-ms",
            str(args.max_wait_ms),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{scorer} server did not start")


async def load(url: str, n: int, concurrency: int, body: dict) -> tuple[list[float], float, int]:
    latencies: list[float] = []
    errors = 0
    todo = iter(range(n))
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as client:

        async def worker():
            nonlocal errors
            for _ in todo:
                t0 = time.perf_counter()
                r = await client.post(f"{url}/v1/score", json=body)
                latencies.append(time.perf_counter() - t0)
                errors += r.status_code != 200

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - t0, errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scorers", default="jpeg,sleep,ocr")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--ocr-requests", type=int, default=60, help="OCR is ~0.1-0.5 s per image on CPU")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-wait-ms", type=float, default=10.0)
    p.add_argument("--sleep-s", type=float, default=0.05, help="per-batch latency of the sleep scorer")
    p.add_argument("--out", type=Path, default=None, help="default: bench/results/http_scorer[_memory].json")
    p.add_argument("--memory", action="store_true", help="the memory-bound flood instead of throughput")
    p.add_argument(
        "--reference",
        action="store_true",
        help="side by side with the common reference (Flask + pickle under gunicorn sync workers): "
        "bench/http_scorer_compare.py",
    )
    p.add_argument("--scenarios", default="judge,ocr", help="--reference: judge (GPU-like) and/or ocr (CPU-bound)")
    p.add_argument(
        "--sides",
        default="ours,reference",
        help="--reference: ours (JSON), ours-pickle (our server's pickle route), ours-binary "
        "(/v1/score/image), before (--before-tree, JSON), reference",
    )
    p.add_argument("--workers", type=int, default=2, help="--reference: processes of each server")
    p.add_argument("--rounds", type=int, default=3, help="--reference: interleaved rounds per side")
    p.add_argument("--judge-seconds", type=float, default=10.0, help="--reference: load time per side and round")
    p.add_argument("--ocr-seconds", type=float, default=30.0, help="--reference: load time per side and round")
    p.add_argument("--settle-s", type=float, default=3.0, help="--reference: completions before this are not counted")
    p.add_argument(
        "--together",
        action="store_true",
        help="--reference: run each of our sides at the same time as the reference (32 clients each), "
        "so both see the same background load; for a busy shared machine",
    )
    p.add_argument("--ours-args", default="", help="--reference: extra flags for our server")
    p.add_argument(
        "--before-tree",
        default=None,
        help="--reference: a checkout of an earlier commit, served as side 'before' (add it to --sides)",
    )
    args = p.parse_args()
    if args.memory:
        return memory(args)
    if args.reference:
        from http_scorer_compare import compare  # this script's directory is on sys.path

        return compare(args)
    args.out = args.out or ROOT / "bench/results/http_scorer.json"
    image = png_b64("HELLO 42")
    results = {}
    loadavg_start = os.getloadavg()
    for scorer in args.scorers.split(","):
        proc, url = start(scorer, args)
        try:
            body = {
                "images": [{"data": image, "format": "png"}],
                "prompts": ["p"],
                "ground_truths": ["HELLO 42"],
                "metadata": {"sleep_s": args.sleep_s},
            }
            asyncio.run(load(url, 4, 2, body))  # warm-up: engine load, first batches
            n = args.ocr_requests if scorer == "ocr" else args.requests
            lat, wall, errors = asyncio.run(load(url, n, args.concurrency, body))
            metrics = httpx.get(f"{url}/metrics").text
            calls = float(re.search(r"^scorer_batch_size_count (\S+)", metrics, re.M).group(1))
            items = float(re.search(r"^scorer_batch_size_sum (\S+)", metrics, re.M).group(1))
            q = np.quantile(lat, [0.5, 0.99])
            results[scorer] = {
                "requests": n,
                "errors": errors,
                "requests_per_s": n / wall,
                "p50_ms": float(q[0] * 1000),
                "p99_ms": float(q[1] * 1000),
                "mean_ms": statistics.fmean(lat) * 1000,
                "mean_batch_size": items / calls,
            }
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    report = {
        "scorers": results,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"{'scorer':8s} {'req/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s} {'batch':>6s} {'errors':>6s}")
    for name, r in results.items():
        print(
            f"{name:8s} {r['requests_per_s']:8.1f} {r['p50_ms']:8.1f} {r['p99_ms']:8.1f} "
            f"{r['mean_batch_size']:6.1f} {r['errors']:6d}"
        )
    print(f"written: {args.out}")


def vm(pid: int, key: str) -> float:
    """``key`` (VmRSS / VmHWM) of the server and its scorer processes together, in MB (VmHWM: the sum of the
    processes' peaks, at least the peak of their sum)."""
    import psutil

    total = 0.0
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        with open(f"/proc/{p.pid}/status") as f:
            total += next(int(line.split()[1]) / 1024 for line in f if line.startswith(key + ":"))
    return total


async def flood(url: str, body: dict, n: int) -> tuple[list[int], list[float], float]:
    health: list[float] = []
    done = asyncio.Event()

    async def poll():
        async with httpx.AsyncClient(timeout=30) as own:
            while not done.is_set():
                t0 = time.perf_counter()
                r = await own.get(f"{url}/health")
                health.append(time.perf_counter() - t0 if r.status_code == 200 else float("inf"))
                await asyncio.sleep(0.1)

    poller = asyncio.create_task(poll())
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=n)) as client:
        codes = [
            r.status_code for r in await asyncio.gather(*(client.post(f"{url}/v1/score", json=body) for _ in range(n)))
        ]
    wall = time.perf_counter() - t0
    done.set()
    await poller
    return codes, health, wall


def memory(args) -> None:
    from collections import Counter

    buf = io.BytesIO()
    Image.fromarray(np.zeros((4000, 4000, 3), np.uint8)).save(buf, format="PNG")
    png = base64.b64encode(buf.getvalue()).decode()
    results = {}
    loadavg_start = os.getloadavg()
    for scorer, per_request in (("ocr_sized_scorer", 16), ("full_size_scorer", 4)):
        proc, url = start(f"bench.http_scorer:{scorer}", args)
        try:
            body = {"images": [{"data": png, "format": "png"}] * per_request, "prompts": ["p"] * per_request}
            small = {"images": [{"data": png_b64("warm"), "format": "png"}], "prompts": ["p"]}
            asyncio.run(load(url, 2, 1, small))
            baseline = vm(proc.pid, "VmRSS")
            budget = httpx.get(f"{url}/health").json()["max_inflight_pixels"]
            codes, health, wall = asyncio.run(flood(url, body, 64))
            results[scorer] = {
                "images_per_request": per_request,
                "body_bytes": len(json.dumps(body)),
                "concurrent": 64,
                "max_inflight_pixels": budget,
                "responses": dict(Counter(codes)),
                "wall_s": wall,
                "rss_baseline_mb": baseline,
                "rss_peak_mb": vm(proc.pid, "VmHWM"),
                "rss_after_mb": vm(proc.pid, "VmRSS"),
                "health_polls": len(health),
                "health_max_ms": max(health) * 1000,
            }
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    out = args.out or ROOT / "bench/results/http_scorer_memory.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "scenarios": results,
                "machine": {"cpus": os.cpu_count(), "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg()},
            },
            indent=1,
        )
    )
    for name, r in results.items():
        print(
            f"{name}: {r['responses']} in {r['wall_s']:.1f}s; RSS {r['rss_baseline_mb']:.0f} -> peak "
            f"{r['rss_peak_mb']:.0f} MB (after {r['rss_after_mb']:.0f}); budget {r['max_inflight_pixels']} px; "
            f"/health max {r['health_max_ms']:.0f} ms over {r['health_polls']} polls"
        )
    print(f"written: {out}")


if __name__ == "__main__":
    main()
