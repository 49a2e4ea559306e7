"""Throughput and latency of the scorer server, on loopback, for the jpeg / sleep / ocr scorers.

    .venv/bin/python bench/http_scorer.py [--concurrency 32] [--requests 400] [--out bench/results/http_scorer.json]

For each scorer it starts ``python -m http_scorer serve`` on a free port, warms it up, then keeps
``--concurrency`` requests in flight (one 64x64 PNG each, protocol v1) until ``--requests`` are done, and reports
requests/s, p50/p99 latency and the mean scorer batch size read from the server's ``/metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
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


def start(scorer: str, args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "http_scorer", "serve", "--scorer", scorer, "--port", str(port),
                             "--max-batch", str(args.max_batch), "--max-wait-ms", str(args.max_wait_ms)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
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
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/http_scorer.json")
    args = p.parse_args()
    image = png_b64("HELLO 42")
    results = {}
    for scorer in args.scorers.split(","):
        proc, url = start(scorer, args)
        try:
            body = {"images": [{"data": image, "format": "png"}], "prompts": ["p"], "ground_truths": ["HELLO 42"],
                    "metadata": {"sleep_s": args.sleep_s}}
            asyncio.run(load(url, 4, 2, body))  # warm-up: engine load, first batches
            n = args.ocr_requests if scorer == "ocr" else args.requests
            lat, wall, errors = asyncio.run(load(url, n, args.concurrency, body))
            metrics = httpx.get(f"{url}/metrics").text
            calls = float(re.search(r"^scorer_batch_size_count (\S+)", metrics, re.M).group(1))
            items = float(re.search(r"^scorer_batch_size_sum (\S+)", metrics, re.M).group(1))
            q = np.quantile(lat, [0.5, 0.99])
            results[scorer] = {"requests": n, "errors": errors, "requests_per_s": n / wall,
                               "p50_ms": float(q[0] * 1000), "p99_ms": float(q[1] * 1000),
                               "mean_ms": statistics.fmean(lat) * 1000, "mean_batch_size": items / calls}
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    report = {"scorers": results, "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"{'scorer':8s} {'req/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s} {'batch':>6s} {'errors':>6s}")
    for name, r in results.items():
        print(f"{name:8s} {r['requests_per_s']:8.1f} {r['p50_ms']:8.1f} {r['p99_ms']:8.1f} "
              f"{r['mean_batch_size']:6.1f} {r['errors']:6d}")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
