"""What every HTTP reward client shares: pooled httpx clients per event loop, retries with backoff, least-loaded
choice among several servers.

Retried: connect errors, timeouts, a dropped connection, and HTTP 408 / 429 / 5xx, with exponential backoff and
full jitter. Not retried: any other 4xx (the request itself is wrong; sending it again cannot help).
"""

from __future__ import annotations

import asyncio
import random
import weakref
from dataclasses import dataclass, field
from typing import Any

import httpx

RETRY_STATUS = {408, 429}


class RewardHTTPError(RuntimeError):
    """A reward server answered with an error that retrying cannot fix, or kept failing past the retries."""


@dataclass
class RetryPolicy:
    max_retries: int = 3
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Full jitter: uniform in [0, min(max, base * 2^attempt)] (spreads retries of many samples apart)."""
        return rng.uniform(0.0, min(self.max_backoff_s, self.backoff_s * (2**attempt)))


@dataclass
class ClientStats:
    calls: int = 0
    retries: int = 0
    errors: int = 0
    inflight: dict[str, int] = field(default_factory=dict)


_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> {key: httpx.AsyncClient}


def pooled_client(key: str, timeout_s: float, max_connections: int = 256) -> httpx.AsyncClient:
    """One ``httpx.AsyncClient`` (connection pool) per event loop and key: a client must not cross loops."""
    loop = asyncio.get_running_loop()
    per_loop = _clients.setdefault(loop, {})
    if key not in per_loop:
        per_loop[key] = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=max_connections,
                                                                                 max_keepalive_connections=64))
    return per_loop[key]


def least_loaded(urls: list[str], stats: ClientStats) -> str:
    return min(urls, key=lambda u: stats.inflight.get(u, 0))


async def post_with_retries(client: httpx.AsyncClient, urls: list[str], path: str, stats: ClientStats,
                            policy: RetryPolicy, rng: random.Random, **request: Any) -> httpx.Response:
    """POST to the least-loaded server; retry what a retry can fix; return a 2xx response or raise."""
    last = ""
    for attempt in range(policy.max_retries + 1):
        url = least_loaded(urls, stats) + path
        stats.calls += 1
        stats.inflight[url.removesuffix(path)] = stats.inflight.get(url.removesuffix(path), 0) + 1
        try:
            response = await client.post(url, **request)
        except (httpx.TransportError, httpx.TimeoutException) as e:
            last = f"{type(e).__name__}: {e}"
        else:
            if response.status_code < 400:
                return response
            last = f"HTTP {response.status_code}: {response.text[:200]}"
            if response.status_code < 500 and response.status_code not in RETRY_STATUS:
                stats.errors += 1
                raise RewardHTTPError(f"{url} answered {last} (not retried: the request itself was refused)")
        finally:
            stats.inflight[url.removesuffix(path)] -= 1
        if attempt < policy.max_retries:
            stats.retries += 1
            await asyncio.sleep(policy.delay(attempt, rng))
    stats.errors += 1
    raise RewardHTTPError(f"{path} failed after {policy.max_retries + 1} attempts; last: {last}")
