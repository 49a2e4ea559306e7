"""The scorer server's server-wide budget of decoded pixels in flight, over real HTTP on loopback: a flood of
decompression-bomb-like requests (small PNG bodies that decode to 48 MB each) gets 503 + Retry-After past the
budget, the server process's peak RSS stays under the bound the budget implies, /health answers throughout, and
the project's client retries the 503s (counting them) until every sample is scored."""

from __future__ import annotations

import asyncio
import base64
import time
from collections import Counter

import httpx
import numpy as np
import pytest
from helpers import record_client_sleeps
from scorer_server_helpers import b64, encode

from http_scorer.budget import BYTES_PER_PIXEL, PixelBudget, TooLarge, default_inflight_pixels
from omni_async.reward.scorers.http import HttpScorer

SIDE = 4000  # a 4000x4000 PNG of zeros: ~50 kB on the wire, 48 MB as a uint8 RGB array
BUDGET = 50_000_000  # pixels: one request of 2 such images (2 x 16 M kept + 16 M decoding = 48 M) at a time
FLOOD = 64


@pytest.fixture(scope="module")
def bomb_b64() -> str:
    return base64.b64encode(encode(np.zeros((SIDE, SIDE, 3), np.uint8))).decode()


def test_flood_of_bomb_requests_gets_503_and_rss_stays_bounded(server_factory, bomb_b64):
    server = server_factory(
        "--scorer",
        "scorer_server_helpers:hold_scorer",
        "--max-inflight-pixels",
        str(BUDGET),
        "--inflight-wait-s",
        "1",
        "--retry-after-s",
        "1",
        "--max-batch",
        "4",
    )
    small = {"images": [b64(np.zeros((8, 8, 3), np.uint8))], "prompts": ["p"], "metadata": {"hold_s": 0}}
    assert httpx.post(f"{server.url}/v1/score", json=small, timeout=30).status_code == 200  # warm: imports, threads
    baseline = server.memory_mb("VmRSS")
    bound = baseline + BUDGET * BYTES_PER_PIXEL / 2**20  # what the budget promises (budget.py's memory model)
    bomb = {"images": [{"data": bomb_b64, "format": "png"}] * 2, "prompts": ["p"] * 2}
    assert len(httpx.Request("POST", "http://x", json=bomb).content) < 200_000  # small on the wire

    async def flood():
        # Each /health answer with the number of flood responses back when it came: where in the flood it was answered.
        health: list[tuple[int, httpx.Response]] = []
        answered = 0
        done = asyncio.Event()
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=FLOOD + 4)) as client:

            async def poll_health():
                async with httpx.AsyncClient(timeout=5) as own:  # its own connection, not queued behind the flood
                    while not done.is_set():
                        r = await own.get(f"{server.url}/health")
                        health.append((answered, r))
                        await asyncio.sleep(0.05)

            async def post() -> httpx.Response:
                nonlocal answered
                r = await client.post(f"{server.url}/v1/score", json=bomb)
                answered += 1
                return r

            poller = asyncio.create_task(poll_health())
            try:
                responses = await asyncio.gather(*(post() for _ in range(FLOOD)))
            finally:
                done.set()
                await poller
        return responses, health

    t0 = time.monotonic()
    responses, health = asyncio.run(flood())
    wall = time.monotonic() - t0
    codes = Counter(r.status_code for r in responses)
    assert set(codes) <= {200, 503} and codes[200] >= 1 and codes[503] >= FLOOD // 2, codes
    for r in responses:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1"
            assert "busy" in r.json()["error"] and "retry after 1s" in r.json()["error"]
        else:
            assert r.json()["scores"] == [SIDE, SIDE]  # the hold scorer has no max_side: full-size arrays
    peak = server.memory_mb("VmHWM")
    assert peak < bound, (peak, bound, baseline)
    # /health answered while the flood was on: before its last answer and with the budget in use by held requests (a
    # server whose event loop the decoding blocked would answer it only between floods). How many answers fall at
    # which stage depends on the box's speed (the 503s can all come back in one burst), so no more is asked.
    assert health and all(h.status_code == 200 for _, h in health)
    assert any(n < FLOOD and h.json()["inflight_pixels"] > 0 for n, h in health), [
        (n, h.json()["inflight_pixels"]) for n, h in health
    ]
    after = httpx.get(f"{server.url}/health").json()
    assert after["inflight_pixels"] == 0 and after["max_inflight_pixels"] == BUDGET  # every reservation returned
    # decoded arrays are freed (and given back to the OS) once the responses are out
    assert server.memory_mb("VmRSS") < baseline + 0.4 * (bound - baseline)

    # A request that could never fit the budget is refused at once with 413, naming the flag.
    r = httpx.post(
        f"{server.url}/v1/score",
        json={"images": [{"data": bomb_b64, "format": "png"}] * 3, "prompts": ["p"] * 3},
        timeout=30,
    )
    assert r.status_code == 413 and "--max-inflight-pixels" in r.json()["error"]
    print(
        f"\nflood of {FLOOD} x 2 x {SIDE}^2 PNG: {dict(codes)} in {wall:.1f}s; RSS baseline {baseline:.0f} MB, "
        f"peak {peak:.0f} MB, bound {bound:.0f} MB; /health answered {len(health)} times"
    )


def test_scorer_max_side_downscales_before_the_scorer_and_reserves_the_downscaled_size(server_factory, bomb_b64):
    # 2 x 4000^2 at full size would need 48 M pixels; downscaled to 256 px the request needs
    # 2 x 256^2 kept + 16 M while decoding, which fits a 20 M budget.
    server = server_factory("--scorer", "scorer_server_helpers:small_side_scorer", "--max-inflight-pixels", "20000000")
    r = httpx.post(
        f"{server.url}/v1/score",
        json={
            "images": [{"data": bomb_b64, "format": "png"}, b64(np.zeros((600, 300, 3), np.uint8), "jpeg")],
            "prompts": ["p"] * 2,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert [d["shape"] for d in r.json()["details"]] == [[256, 256, 3], [256, 128, 3]]


def test_client_retries_503_honouring_retry_after_and_counts_retries(server_factory, monkeypatch):
    # One 1000x1000 request (2 M pixels with its decode) fits the 2.5 M budget at a time; the others wait 0.1 s,
    # get 503 + Retry-After: 1, and the client retries them after that second until all are scored.
    server = server_factory(
        "--scorer",
        "scorer_server_helpers:hold_scorer",
        "--max-inflight-pixels",
        "2500000",
        "--inflight-wait-s",
        "0.1",
        "--retry-after-s",
        "1",
    )
    images = [np.full((1000, 1000, 3), i, np.uint8) for i in range(4)]
    client = HttpScorer(server.url, max_batch=1, max_wait_ms=1, max_retries=10, backoff_s=0.01, hold_s=0.3)

    async def run():
        return await asyncio.gather(*(client.compute_score("x", img, None, {}) for img in images))

    slept = record_client_sleeps(monkeypatch)  # waited for real: the budget frees as the scorer lets go
    out = asyncio.run(run())
    assert [o["score"] for o in out] == [1000.0] * 4
    retries = [o["http_retries"] for o in out]
    assert sum(retries) >= 1 and sum(retries) == client.stats.retries, retries
    assert all(o["http_timeouts"] == 0 for o in out)
    # Every retry waited the server's Retry-After (1 s, plus at most the 10 ms jitter; the backoff alone: <= 10 ms).
    assert len(slept) == sum(retries) and all(1.0 <= d <= 1.01 for d in slept), slept
    metrics = httpx.get(f"{server.url}/metrics").text
    assert f"scorer_busy_rejections_total {float(sum(retries))}" in metrics


def test_pixel_budget_is_fifo_bounded_and_returns_what_it_grants():
    async def run():
        budget = PixelBudget(10)
        assert await budget.acquire(6, 0.01)
        assert not await budget.acquire(5, 0.05)  # waited, then gave up
        assert budget.used == 6 and budget.waiting() == 0
        with pytest.raises(TooLarge):
            await budget.acquire(11, 1)
        big = asyncio.create_task(budget.acquire(8, 5))
        await asyncio.sleep(0.01)
        small = asyncio.create_task(budget.acquire(2, 5))  # would fit now, but waits behind the older request
        await asyncio.sleep(0.01)
        assert not small.done()
        budget.release(6)
        assert await big and await small and budget.used == 10
        waiter = asyncio.create_task(budget.acquire(1, 5))
        await asyncio.sleep(0.01)
        waiter.cancel()  # a client that goes away while waiting leaves nothing reserved
        with pytest.raises(asyncio.CancelledError):
            await waiter
        budget.release(8)
        budget.release(2)
        assert budget.used == 0 and budget.waiting() == 0

    asyncio.run(run())
    assert default_inflight_pixels(available=8 << 30) == (1 << 30) // BYTES_PER_PIXEL  # an eighth of 8 GiB
    assert default_inflight_pixels(available=64 << 30) == (2 << 30) // BYTES_PER_PIXEL  # capped at 2 GiB
