"""``bench/http_scorer.py --reference``: the scorer server against the common reference, side by side, interleaved.

The reference (``bench/reference_server.py``) is a Flask app under gunicorn sync workers, pickle in and out, one
scorer call per request -- what flow_grpo's reward servers are. Both servers run the same scorer function with the
same number of processes (``--workers``), on this machine, both started at once; the load is ``--concurrency``
closed-loop clients, each sending one 512x512 JPEG per request and the next as soon as the answer comes. By
default one server is loaded at a time and rounds alternate the order (ours, ref / ref, ours, ...); with
``--together`` each of our sides is loaded at the same time as the reference (``--concurrency`` clients each),
so both see the same background load at every instant -- on a shared machine whose load swings within seconds,
back-to-back runs do not. Each side's figure is the median over rounds, and the ratio is taken per round (ours /
the reference measured next to it, or with it) and its median reported.

Per side and round: images/s over the measured window (completions after ``--settle-s``, until the deadline),
p50 / p99 latency, the servers' CPU seconds per image (all their processes, from /proc), the client's CPU seconds
per image, and how the clients' connections were spread over the server's worker processes (sampled mid-run).

Scenarios: ``judge`` (``bench.scorer_stand_ins:gpu_like_judge``: 50 ms per call + 2 ms per image, waiting as on a GPU)
and ``ocr`` (the ``ocr`` scorer, PP-OCR on CPU). flask and gunicorn are installed on first use into
``bench/.reference-deps`` (pinned in ``bench/reference-requirements.txt``), never into the project's environment.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import pickle
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlencode

import httpx
import numpy as np
import psutil
from PIL import Image, ImageDraw, ImageFont

ROOT = Path(__file__).resolve().parents[1]
REF_DEPS = ROOT / "bench/.reference-deps"
REF_REQUIREMENTS = ROOT / "bench/reference-requirements.txt"
SCENARIOS = {
    "judge": "bench.scorer_stand_ins:gpu_like_judge",
    "serial": "bench.scorer_stand_ins:serial_scorer",
    "ocr": "ocr",
}
TARGET = "HELLO 42"


def sample_jpeg(side: int = 512, seed: int = 0) -> bytes:
    """A 512x512 JPEG with the target text on a noisy background (what a text-rendering policy produces)."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(170, 250, side, dtype=np.float32)
    base = (ramp[None, :, None] + ramp[:, None, None]) / 2 + rng.normal(0, 6, size=(side, side, 3))
    img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    ImageDraw.Draw(img).text(
        (side // 8, side // 3), TARGET, fill=(10, 10, 40), font=ImageFont.load_default(size=side // 8)
    )
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def ensure_reference_deps() -> None:
    if (REF_DEPS / "flask").is_dir() and (REF_DEPS / "gunicorn").is_dir():
        return
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(REF_DEPS), "-r", str(REF_REQUIREMENTS)],
        check=True,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """One server (ours or the reference) as a process tree on a port."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str], cwd: Path = ROOT, workers: int = 1):
        self.name, self.port, self.url, self.workers = name, port, f"http://127.0.0.1:{port}", workers
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {self.proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{name} did not come up on {self.url}")

    def processes(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def cpu_by_process(self) -> dict[int, float]:
        out = {}
        for p in self.processes():
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return out

    def cpu_seconds(self) -> float:
        return sum(self.cpu_by_process().values())

    def connections(self) -> list[int]:
        """Established client connections held by each of the server's processes (sorted, largest first)."""
        counts = []
        for p in self.processes():
            try:
                conns = p.net_connections(kind="tcp")
            except psutil.NoSuchProcess:
                continue
            counts.append(
                sum(1 for c in conns if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == self.port)
            )
        return sorted(counts, reverse=True)

    def scorer_counters(self) -> tuple[float, float, float] | None:
        """Our server's (seconds its scorer processes spent decoding and scoring, scorer calls, items in them) so
        far, from /metrics; None for the reference (and for a tree without the scorer processes' metrics)."""
        if self.name == "reference":
            return None
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        inside = re.findall(r'^scorer_process_seconds_sum\{stage="\w+"\} (\S+)$', text, re.M)
        calls = re.search(r"^scorer_batch_size_count (\S+)$", text, re.M)
        items = re.search(r"^scorer_batch_size_sum (\S+)$", text, re.M)
        if not inside or not calls or not items:
            return None
        return sum(float(x) for x in inside), float(calls.group(1)), float(items.group(1))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_ours(scorer: str, args, env, tree: Path = ROOT, name: str = "ours") -> Served:
    """Our server from this checkout, or (``tree``) from another checkout of the repository, e.g. an earlier
    commit (``git worktree add --detach /tmp/before <commit>``), to measure a change side by side."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "http_scorer",
        "serve",
        "--scorer",
        scorer,
        "--port",
        str(port),
        "--workers",
        str(args.workers),
        "--max-batch",
        str(args.max_batch),
        "--max-wait-ms",
        str(args.max_wait_ms),
        "--allow-flow-grpo-pickle",
        "--request-timeout-s",
        "300",
        *args.ours_args.split(),
    ]  # gunicorn's below
    env = {**env, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)])}  # the scorer specs live in bench/ here
    return Served(name, cmd, port, env, cwd=tree, workers=args.workers)


def start_reference(scorer: str, args, env) -> Served:
    port = free_port()
    env = {**env, "PYTHONPATH": os.pathsep.join([str(REF_DEPS), str(ROOT), env.get("PYTHONPATH", "")])}
    cmd = [
        sys.executable,
        "-m",
        "gunicorn",
        "-w",
        str(args.workers),
        "-b",
        f"127.0.0.1:{port}",
        "--timeout",
        "300",
        "--log-level",
        "warning",
        f"bench.reference_server:create_app(scorer={scorer!r})",
    ]
    return Served("reference", cmd, port, env, workers=args.workers)


def requests_for(jpeg: bytes) -> dict[str, tuple[str, bytes, dict[str, str]]]:
    """(path, body, headers) per request form, serialised once (the client's cost is the same every request)."""
    json_body = json.dumps(
        {
            "images": [{"data": base64.b64encode(jpeg).decode(), "format": "jpeg"}],
            "prompts": ["a sign"],
            "ground_truths": [TARGET],
        }
    ).encode()
    pickled = pickle.dumps({"images": [jpeg], "prompts": ["a sign"], "metadata": {"ground_truths": [TARGET]}})
    return {
        "json": ("/v1/score", json_body, {"content-type": "application/json"}),
        "pickle": ("/", pickled, {"content-type": "application/octet-stream"}),
        "binary": (
            "/v1/score/image?" + urlencode({"prompt": "a sign", "ground_truth": TARGET}),
            jpeg,
            {"content-type": "image/jpeg"},
        ),
    }


class Connection:
    """One keep-alive HTTP/1.1 client connection, the load generator's: a fraction of a millisecond of CPU per
    request where httpx spends several, so on a shared 2-core machine the CPU goes to the servers under test.
    Reconnects when the server closed the connection (gunicorn's sync workers close after every response)."""

    def __init__(self, port: int):
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, head: bytes, body: bytes) -> tuple[int, bytes]:
        for attempt in (0, 1):
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
            try:
                self.writer.write(head + body)
                raw = await self.reader.readuntil(b"\r\n\r\n")
                break
            except (ConnectionError, asyncio.IncompleteReadError):  # a kept-alive connection the server closed
                self.close()
                if attempt:
                    raise
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
        body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection") == "close":
            self.close()
        return status, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def drive(
    server: Served, request: tuple[str, bytes, dict], concurrency: int, seconds: float, settle_s: float
) -> dict:
    path, body, headers = request
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Length: {len(body)}\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        + "\r\n"
    ).encode()
    done: list[tuple[float, float]] = []  # (completion time, latency)
    errors: list[str] = []
    conn_samples: list[list[int]] = []
    conns = [Connection(server.port) for _ in range(concurrency)]
    try:
        t0 = time.perf_counter()
        stop_at = t0 + seconds

        async def one_client(conn: Connection):
            while time.perf_counter() < stop_at:
                t = time.perf_counter()
                try:
                    status, answer = await conn.post(head, body)
                except (OSError, asyncio.IncompleteReadError) as e:
                    errors.append(type(e).__name__)
                    conn.close()
                    continue
                if status != 200:
                    errors.append(f"{status}: {answer[:200]!r}")
                    continue
                end = time.perf_counter()
                done.append((end - t0, end - t))

        async def sample_connections():
            for frac in (0.3, 0.6, 0.9):
                await asyncio.sleep(max(0.0, t0 + frac * seconds - time.perf_counter()))
                conn_samples.append(server.connections())

        cpu0, client0, inside0 = server.cpu_by_process(), time.process_time(), server.scorer_counters()
        sampler = asyncio.create_task(sample_connections())
        await asyncio.gather(*(one_client(c) for c in conns))
        await sampler
        cpu1, client1, inside1 = server.cpu_by_process(), time.process_time(), server.scorer_counters()
        wall = time.perf_counter() - t0
    finally:
        for c in conns:
            c.close()
    window = [lat for t, lat in done if settle_s <= t <= seconds]
    n_all = max(1, len(done))
    q = np.quantile([lat for _, lat in done], [0.5, 0.99]) if done else [float("nan")] * 2
    last = max((t for t, _ in done), default=seconds)
    return {
        "images_per_s": len(done) / last,
        "images": len(done),
        "wall_s": last,
        "steady_images_per_s": len(window) / (seconds - settle_s),
        "errors": len(errors),
        "first_errors": errors[:3],
        "p50_ms": float(q[0] * 1000),
        "p99_ms": float(q[1] * 1000),
        "server_cpu_s_per_image": (sum(cpu1.values()) - sum(cpu0.values())) / n_all,
        "client_cpu_s_per_image": (client1 - client0) / n_all,
        # our server only: the share of the run its scorer processes spent decoding and scoring (the rest is
        # waiting for work or for the CPU); from their own metrics
        "scorer_processes_busy": (
            None if inside0 is None or inside1 is None else round((inside1[0] - inside0[0]) / wall / server.workers, 3)
        ),
        "mean_batch": (
            None
            if inside0 is None or inside1 is None or inside1[1] == inside0[1]
            else round((inside1[2] - inside0[2]) / (inside1[1] - inside0[1]), 2)
        ),
        "server_cores_busy_by_process": sorted(
            (round((cpu1[p] - cpu0.get(p, 0.0)) / wall, 2) for p in cpu1), reverse=True
        ),
        "connections_per_process": conn_samples,
    }


async def drive_together(
    plans: list[tuple[Served, tuple]], concurrency: int, seconds: float, settle_s: float
) -> list[dict]:
    """Load several servers at the same time, ``concurrency`` clients each: they share the machine's background
    load at every instant, so their ratio holds on a busy shared machine where back-to-back runs do not.
    (``client_cpu_s_per_image`` then counts the one client process's CPU for both.)"""
    return list(
        await asyncio.gather(*(drive(server, request, concurrency, seconds, settle_s) for server, request in plans))
    )


def warm(server: Served, request, n: int) -> None:
    """Enough concurrent requests that every worker process has loaded its scorer (OCR engines load lazily)."""

    async def go():
        async with httpx.AsyncClient(timeout=300) as client:
            path, body, headers = request
            for _ in range(2):
                rs = await asyncio.gather(
                    *(client.post(server.url + path, content=body, headers=headers) for _ in range(n))
                )
                bad = [r for r in rs if r.status_code != 200]
                if bad:
                    raise RuntimeError(f"{server.name} warm-up: {bad[0].status_code} {bad[0].text[:300]}")

    asyncio.run(go())


def record(rounds: dict[str, list[dict]], scenario: str, r: int, side: str, res: dict) -> None:
    res["round"], res["loadavg"] = r, os.getloadavg()[0]
    rounds[side].append(res)
    print(
        f"{scenario:5s} round {r} {side:12s} {res['images_per_s']:7.1f} img/s  p50 {res['p50_ms']:7.0f} ms  "
        f"server cpu {res['server_cpu_s_per_image'] * 1000:6.1f} ms/img  conns {res['connections_per_process'][1]}  "
        f"cores {res['server_cores_busy_by_process']}  scorer busy {res['scorer_processes_busy']}  "
        f"batch {res['mean_batch']}  errors {res['errors']}",
        flush=True,
    )


def compare(args) -> None:
    ensure_reference_deps()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    forms = requests_for(sample_jpeg())
    sides = args.sides.split(",")  # e.g. ours (JSON), ours-pickle, ours-binary, reference
    report: dict = {"scenarios": {}, "machine": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}}
    for scenario in args.scenarios.split(","):
        scorer = SCENARIOS[scenario]
        seconds = args.ocr_seconds if scenario == "ocr" else args.judge_seconds
        servers = {"ours": start_ours(scorer, args, env), "reference": start_reference(scorer, args, env)}
        if args.before_tree:
            servers["before"] = start_ours(scorer, args, env, Path(args.before_tree), "before")
        try:
            # side = server[-form]: ours (JSON), ours-binary, ours-pickle, before (JSON), reference (pickle)
            plan = {
                side: (
                    servers[side.split("-")[0]],
                    forms["pickle" if side == "reference" else side.split("-")[1] if "-" in side else "json"],
                )
                for side in sides
            }
            for server, request in plan.values():
                warm(server, request, 4 * args.workers)
            rounds: dict[str, list[dict]] = {side: [] for side in sides}
            ratios: dict[str, list[float]] = {side: [] for side in sides if side != "reference"}

            for r in range(args.rounds):
                if args.together:  # each of our sides at the same time as the reference, 32 clients each
                    for side in ratios:
                        ours, ref = asyncio.run(
                            drive_together([plan[side], plan["reference"]], args.concurrency, seconds, args.settle_s)
                        )
                        record(rounds, scenario, r, side, ours)
                        record(rounds, scenario, r, "reference", ref)
                        ratios[side].append(ours["images_per_s"] / ref["images_per_s"])
                    continue
                for side in sides if r % 2 == 0 else sides[::-1]:
                    server, request = plan[side]
                    record(
                        rounds,
                        scenario,
                        r,
                        side,
                        asyncio.run(drive(server, request, args.concurrency, seconds, args.settle_s)),
                    )
            if not args.together and "reference" in rounds:
                ratios = {
                    side: [
                        a["images_per_s"] / b["images_per_s"]
                        for a, b in zip(rounds[side], rounds["reference"], strict=True)
                    ]
                    for side in ratios
                }
            summary = {}
            for side, rs in rounds.items():
                summary[side] = {
                    "images_per_s_median": statistics.median(x["images_per_s"] for x in rs),
                    "p50_ms_median": statistics.median(x["p50_ms"] for x in rs),
                    "p99_ms_median": statistics.median(x["p99_ms"] for x in rs),
                    "server_cpu_ms_per_image_median": 1000 * statistics.median(x["server_cpu_s_per_image"] for x in rs),
                    "rounds": rs,
                }
            report["scenarios"][scenario] = {
                "scorer": scorer,
                "seconds_per_side_and_round": seconds,
                "together": bool(args.together),
                "sides": summary,
                "ratio_to_reference_per_round": ratios,
                "ratio_to_reference_median": {k: statistics.median(v) for k, v in ratios.items()},
            }
        finally:
            for server in servers.values():
                server.stop()
    report["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report["machine"]["loadavg_end"] = os.getloadavg()
    out = args.out or ROOT / "bench/results/http_scorer_reference.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(markdown_table(report))
    print(f"written: {out}")


def markdown_table(report: dict) -> str:
    """The README's table, from the JSON this writes (``python -c`` it on a saved report to redo the table)."""
    rows = [
        "| scenario | side | images/s (median) | × reference (median of rounds) | per round | p50 ms | "
        "server CPU ms/image | load avg per round |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for scenario, sc in report["scenarios"].items():
        for side, s in sc["sides"].items():
            per_round = sc["ratio_to_reference_per_round"].get(side)
            loads = " / ".join(f"{x['loadavg']:.1f}" for x in s["rounds"])
            rows.append(
                f"| {scenario} | {side} | {s['images_per_s_median']:.1f} | "
                f"{sc['ratio_to_reference_median'].get(side, 1.0):.2f} | "
                f"{' / '.join(f'{r:.2f}' for r in per_round) if per_round else '—'} | "
                f"{s['p50_ms_median']:.0f} | {s['server_cpu_ms_per_image_median']:.1f} | "
                f"{loads} |"
            )
    return "\n".join(rows)
