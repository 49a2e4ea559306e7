"""What every HTTP reward client shares: pooled httpx clients per event loop, retries with backoff, least-loaded
choice among several servers.

Retried: connect errors, timeouts, a dropped connection, and HTTP 408 / 429 / 5xx, with exponential backoff and
full jitter; a 503 / 429 with ``Retry-After`` (seconds or an HTTP date) waits that long instead (at most
``RetryPolicy.max_retry_after_s``) plus a little jitter. Not retried: any other 4xx (the request itself is wrong;
sending it again cannot help). Every retry is counted (``ClientStats`` for the process, an optional
``RetryTally`` per call: the reward functions return it per sample as ``http_retries`` / ``http_timeouts``), and
every error names the URL it was sent to.

Logging (``omni_async.logs``), at most one line per server and kind per :data:`LOG_INTERVAL_S` (counting the ones
held back), since these events come at the sample rate when a server is down: an attempt that timed out and a call
given up (retries exhausted, or refused with a 4xx) are WARNING, a call answered only after retries is INFO; each
retried attempt is DEBUG.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import random
import time
import weakref
from dataclasses import dataclass, field, fields
from typing import Any

import httpx

from omni_async.logs import Throttle

logger = logging.getLogger(__name__)

RETRY_STATUS = {408, 429}
LOG_INTERVAL_S = 30.0
_throttle = Throttle(LOG_INTERVAL_S)  # per process: every client of a server shares its reports


class RewardHTTPError(RuntimeError):
    """A reward server answered with an error that retrying cannot fix, or kept failing past the retries."""


@dataclass
class RetryPolicy:
    max_retries: int = 3
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    max_retry_after_s: float = 30.0  # a server's Retry-After is honoured up to this

    def delay(self, attempt: int, rng: random.Random, retry_after_s: float | None = None) -> float:
        """Full jitter: uniform in [0, min(max, base * 2^attempt)] (spreads retries of many samples apart); with a
        ``Retry-After``, that wait (capped) plus up to ``backoff_s`` of jitter."""
        if retry_after_s is not None:
            return min(self.max_retry_after_s, retry_after_s) + rng.uniform(0.0, self.backoff_s)
        return rng.uniform(0.0, min(self.max_backoff_s, self.backoff_s * (2**attempt)))


def retry_after_seconds(value: str | None) -> float | None:
    """``Retry-After`` as seconds: delta-seconds or an HTTP date; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time()) if when is not None else None


@dataclass
class RetryTally:
    """One call's HTTP-level retries (``retries``: attempts after the first) and attempts that timed out."""

    retries: int = 0
    timeouts: int = 0


@dataclass
class ClientStats:
    calls: int = 0
    retries: int = 0
    timeouts: int = 0
    errors: int = 0
    inflight: dict[str, int] = field(default_factory=dict)


_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> {key: httpx.AsyncClient}


def pooled_client(key: str, timeout_s: float, max_connections: int = 256) -> httpx.AsyncClient:
    """One ``httpx.AsyncClient`` (connection pool) per event loop and key: a client must not cross loops."""
    loop = asyncio.get_running_loop()
    per_loop = _clients.setdefault(loop, {})
    if key not in per_loop:
        per_loop[key] = httpx.AsyncClient(
            timeout=timeout_s, limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=64)
        )
    return per_loop[key]


@dataclass
class Connection:
    """How one client reaches its servers, from its reward kwargs (the HTTP scorer's and the OpenAI judge's share
    them): the servers (least-loaded first), the timeout, the retry policy, a bearer token; with the client's
    :class:`ClientStats` and the random stream of its retry jitter (``seed``)."""

    urls: str | list[str]
    timeout_s: float = 60.0
    max_retries: int = 3
    backoff_s: float = 0.2
    max_retry_after_s: float = 30.0
    token: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        self.urls = [u.rstrip("/") for u in ([self.urls] if isinstance(self.urls, str) else list(self.urls))]
        self.timeout_s = float(self.timeout_s)
        self.policy = RetryPolicy(
            max_retries=int(self.max_retries),
            backoff_s=float(self.backoff_s),
            max_retry_after_s=float(self.max_retry_after_s),
        )
        self.headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self.stats = ClientStats()
        self.rng = random.Random(self.seed)

    @classmethod
    def split(cls, urls: str | list[str], options: dict[str, Any]) -> tuple[Connection, dict[str, Any]]:
        """The connection made of ``options``' keys that name its fields, and the other keys (which the HTTP scorer
        forwards to its server as metadata)."""
        own = {f.name for f in fields(cls)} - {"urls"}
        return cls(urls, **{k: v for k, v in options.items() if k in own}), {
            k: v for k, v in options.items() if k not in own
        }

    async def post(self, pool: str, path: str, tally: RetryTally | None = None, **request: Any) -> httpx.Response:
        """:func:`post_with_retries` on the ``pool`` key's pooled client of this event loop."""
        client = pooled_client(pool, self.timeout_s)
        return await post_with_retries(
            client, self.urls, path, self.stats, self.policy, self.rng, tally, headers=self.headers, **request
        )


def least_loaded(urls: list[str], stats: ClientStats) -> str:
    return min(urls, key=lambda u: stats.inflight.get(u, 0))


async def post_with_retries(
    client: httpx.AsyncClient,
    urls: list[str],
    path: str,
    stats: ClientStats,
    policy: RetryPolicy,
    rng: random.Random,
    tally: RetryTally | None = None,
    **request: Any,
) -> httpx.Response:
    """POST to the least-loaded server; retry what a retry can fix; return a 2xx response or raise
    :class:`RewardHTTPError` naming the URL. Retries and timeouts are added to ``stats`` and ``tally``."""
    tally = tally if tally is not None else RetryTally()
    last, tried = "", []
    for attempt in range(policy.max_retries + 1):
        base = least_loaded(urls, stats)
        url = base + path
        if url not in tried:
            tried.append(url)
        stats.calls += 1
        stats.inflight[base] = stats.inflight.get(base, 0) + 1
        retry_after = None
        try:
            response = await client.post(url, **request)
        except httpx.TimeoutException as e:
            stats.timeouts += 1
            tally.timeouts += 1
            last = f"{type(e).__name__} after {_timeout_s(client)} from {url}"
            _report(logging.WARNING, ("timeout", url), "reward server timed out: %s", last)
        except httpx.TransportError as e:
            last = f"{type(e).__name__}: {e or 'connection failed'} ({url})"
        else:
            if response.status_code < 400:
                if attempt:
                    _report(logging.INFO, ("resent", url), "POST %s answered after %d retries", url, attempt)
                return response
            last = f"HTTP {response.status_code} from {url}: {response.text[:200]}"
            if response.status_code < 500 and response.status_code not in RETRY_STATUS:
                stats.errors += 1
                error = (
                    f"POST {url} answered HTTP {response.status_code}: {response.text[:200]} "
                    "(not retried: the request itself was refused)"
                )
                _report(logging.WARNING, ("refused", url), "reward call failed: %s", error)
                raise RewardHTTPError(error)
            if response.status_code in (429, 503):
                retry_after = retry_after_seconds(response.headers.get("retry-after"))
        finally:
            stats.inflight[base] -= 1
        if attempt < policy.max_retries:
            stats.retries += 1
            tally.retries += 1
            delay = policy.delay(attempt, rng, retry_after)
            logger.debug("POST attempt %d failed (%s); retrying in %.2fs", attempt + 1, last, delay)
            await asyncio.sleep(delay)
    stats.errors += 1
    error = (
        f"POST {' / '.join(tried)} failed after {policy.max_retries + 1} attempts; last: {last}. "
        "Check that the server is running and reachable at that address."
    )
    _report(logging.WARNING, ("exhausted", tuple(tried)), "reward retries exhausted: %s", error)
    raise RewardHTTPError(error)


def _report(level: int, key: tuple, msg: str, *args: Any) -> None:
    """``msg`` at ``level``, at most once per ``key`` per :data:`LOG_INTERVAL_S`, with the count held back."""
    if logger.isEnabledFor(level) and (held := _throttle.ready(key)) is not None:
        logger.log(level, msg + " (%d more since the last report)", *args, held)


def _timeout_s(client: httpx.AsyncClient) -> str:
    t = client.timeout
    return f"{t.read:g}s" if t.read is not None else "the client's timeout"
