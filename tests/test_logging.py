"""Python logging (``omni_async.logs``): ``trainer.log_level`` is checked and reaches the driver and the Ray workers;
reward failures past their retries, re-sends, timeouts and a high failure rate are logged, at most once per window."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
import ray
from ray.exceptions import RayActorError

from omni_async import logs
from omni_async.cluster import init_ray, shutdown_ray
from omni_async.logs import LOG_LEVEL_ENV, Throttle, check_log_level, setup_logging
from omni_async.reward import http_client
from omni_async.reward.dispatcher import FailureRate, RewardDispatcher
from omni_async.reward.http_client import ClientStats, RetryPolicy, RewardHTTPError, post_with_retries
from omni_async.sample import RewardOutcome
from omni_async.trainer.config import compose


@pytest.fixture
def fresh_logger(monkeypatch):
    """The ``omni_async`` logger without this module's handler (as in a new process), restored afterwards."""
    pkg = logging.getLogger("omni_async")
    handlers, level = list(pkg.handlers), pkg.level
    pkg.handlers = [h for h in handlers if not getattr(h, "_omni_async", False)]
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    yield pkg
    pkg.handlers, pkg.level = handlers, level


def test_an_invalid_log_level_is_refused_naming_the_key_and_the_fix():
    with pytest.raises(ValueError, match=r"trainer\.log_level='LOUD'.*Fix: set trainer\.log_level to one of DEBUG"):
        check_log_level("LOUD")
    with pytest.raises(ValueError, match=r"trainer\.log_level=10"):
        check_log_level(10)
    assert check_log_level("debug") == "DEBUG" and check_log_level(" Warning ") == "WARNING"


def test_init_ray_refuses_a_bad_level_before_starting_ray_and_hands_a_good_one_to_the_workers(
    monkeypatch, fresh_logger
):
    seen: dict = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # ray.init is a spy: no cluster starts, none is joined
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {})
    with pytest.raises(ValueError, match=r"trainer\.log_level='chatty'"):
        init_ray(compose(["data.train_files=x.jsonl", "trainer.log_level=chatty"]))
    assert not seen
    init_ray(compose(["data.train_files=x.jsonl", "trainer.log_level=warning"]))
    assert seen["runtime_env"]["env_vars"][LOG_LEVEL_ENV] == "WARNING"
    assert fresh_logger.level == logging.WARNING  # the driver's own logging too


def test_setup_logging_sets_the_level_and_adds_one_handler(fresh_logger, monkeypatch, capsys):
    setup_logging("DEBUG")
    setup_logging("ERROR")
    ours = [h for h in fresh_logger.handlers if getattr(h, "_omni_async", False)]
    assert len(ours) == 1 and fresh_logger.level == logging.ERROR
    setup_logging()  # an actor's __init__ after the process setup hook: changes nothing
    assert fresh_logger.level == logging.ERROR
    logging.getLogger("omni_async.reward.somewhere").error("it broke")
    line = capsys.readouterr().err.strip()
    assert "ERROR omni_async.reward.somewhere pid=" in line and line.endswith(": it broke")

    fresh_logger.handlers = [h for h in fresh_logger.handlers if not getattr(h, "_omni_async", False)]
    monkeypatch.setenv(LOG_LEVEL_ENV, "debug")  # a worker's first call: the level from its runtime env
    assert setup_logging().level == logging.DEBUG
    fresh_logger.handlers = [h for h in fresh_logger.handlers if not getattr(h, "_omni_async", False)]
    monkeypatch.setenv(LOG_LEVEL_ENV, "nope")
    with pytest.raises(ValueError, match=LOG_LEVEL_ENV):
        setup_logging()


def test_a_record_prints_once_beside_a_console_handler_on_the_root(fresh_logger, monkeypatch, capsys):
    """``import verl`` runs ``logging.basicConfig`` (a console handler on the root): the package's records skip it
    (ours printed them) and still propagate; other records still reach it."""
    import io

    root = logging.getLogger()
    console = logging.StreamHandler(io.StringIO())  # what basicConfig adds
    monkeypatch.setattr(root, "handlers", [console])
    setup_logging("INFO")
    logging.getLogger("omni_async.cluster").info("ours")
    logging.getLogger("verl.something").warning("theirs")
    assert console.stream.getvalue() == "theirs\n"
    assert capsys.readouterr().err.count("ours") == 1

    monkeypatch.setattr(root, "handlers", [])  # a Ray worker's process before it imports verl
    setup_logging()
    logging.basicConfig()  # verl's import: adds nothing now
    assert len(root.handlers) == 1
    logging.getLogger("omni_async.cluster").warning("ours again")
    logging.getLogger("verl.something").warning("theirs again")
    err = capsys.readouterr().err
    assert err.count("ours again") == 1 and "WARNING verl.something pid=" in err


def test_throttle_lets_one_report_per_window_through_and_counts_the_rest():
    now = [0.0]
    t = Throttle(30.0, clock=lambda: now[0])
    assert t.ready("a") == 0
    assert t.ready("a") is None and t.ready("a") is None
    assert t.ready("b") == 0  # keys are independent
    now[0] = 31.0
    assert t.ready("a") == 2


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class _Worker:
    """A reward worker stand-in with the dispatcher's two calls: ``score_many`` (``score`` on each record) and the
    ``info`` probe."""

    def __init__(self, score):
        self.score_many, self.info = _Method(lambda records: asyncio.gather(*map(score, records))), _Method(self._dead)

    @staticmethod
    async def _dead():
        raise RayActorError()


async def _dies(chunk):
    raise RayActorError()


def test_a_reward_given_up_after_its_resends_logs_the_resend_and_a_warning(caplog):
    async def run():
        d = RewardDispatcher(
            [_Worker(_dies), _Worker(_dies)], queue_size=4, max_inflight_per_worker=2, timeout_s=5, max_resends=1
        )
        outcome = await d.score(object())
        await asyncio.sleep(0.05)  # the revive probes of the dead workers end
        return outcome

    with caplog.at_level(logging.INFO, logger="omni_async"):
        outcome = asyncio.run(run())
    assert outcome.status == "failed"
    records = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert any(lvl == logging.INFO and "re-sending it, attempt 2 of 2" in msg for _, lvl, msg in records), records
    assert any(
        name == "omni_async.reward.dispatcher" and lvl == logging.WARNING and "re-sends exhausted" in msg
        for name, lvl, msg in records
    ), records
    assert any(lvl == logging.WARNING and "did not come back" in msg for _, lvl, msg in records), records


def test_a_scorer_timing_out_is_a_warning_once_per_window(caplog):
    async def score(chunk):
        return RewardOutcome("timeout", error="judge: no result within reward.timeout_s=1s")

    async def run():
        d = RewardDispatcher([_Worker(score)], queue_size=4, max_inflight_per_worker=4, timeout_s=5)
        for _ in range(5):
            await d.score(object())

    with caplog.at_level(logging.INFO, logger="omni_async.reward.dispatcher"):
        asyncio.run(run())
    timeouts = [r.getMessage() for r in caplog.records if "timed out" in r.getMessage()]
    assert len(timeouts) == 1 and "reward.timeout_s=1s" in timeouts[0], timeouts
    assert all(r.levelno == logging.WARNING for r in caplog.records if "timed out" in r.getMessage())


def test_failure_rate_warns_once_above_the_threshold_and_says_when_it_recovered(caplog):
    rate = FailureRate(window=10, min_outcomes=5, warn=0.2, clear=0.1)
    assert [rate.observe(f) for f in (True, False, False, False)] == [None] * 4  # too few to judge
    assert rate.observe(False) is None  # 1 of 5 = 20%: not above
    assert rate.observe(True) == "degraded"  # 2 of 6
    assert rate.observe(True) is None  # still degraded: no second report
    changes = [rate.observe(False) for _ in range(10)]
    assert changes.count("recovered") == 1 and not rate.degraded

    verdicts = iter([True] * 30 + [False] * 13 + [True] * 150)  # True: ok; 4 failures of 34 cross 10%

    async def score(chunk):
        return RewardOutcome("ok", score=1.0) if next(verdicts) else RewardOutcome("failed", error="judge: HTTP 500")

    async def run():
        d = RewardDispatcher([_Worker(score)], queue_size=8, max_inflight_per_worker=8, timeout_s=5, scorers="judge")
        for _ in range(193):
            await d.score(object())

    with caplog.at_level(logging.INFO, logger="omni_async.reward.dispatcher"):
        asyncio.run(run())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "failure rate 12%" in warnings[0] and "judge: HTTP 500" in warnings[0], warnings
    assert sum("back to" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO) == 1


def _post(handler, retries: int = 2) -> httpx.Response:
    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), timeout=1.0) as client:
            return await post_with_retries(
                client, ["http://scorer:1"], "/v1/score", ClientStats(), RetryPolicy(retries, backoff_s=0.0), _rng()
            )

    return asyncio.run(run())


def _rng():
    import random

    return random.Random(0)


def test_http_retries_exhausted_timeouts_and_a_resent_call_are_logged_once_per_window(caplog, monkeypatch):
    monkeypatch.setattr(http_client, "_throttle", logs.Throttle(60.0))  # no report held back by another test
    answers = iter([503, 200])

    with caplog.at_level(logging.INFO, logger="omni_async"):
        assert _post(lambda request: httpx.Response(next(answers))).status_code == 200
        for _ in range(3):  # three failed calls: one report, the others counted into the next one
            with pytest.raises(RewardHTTPError):
                _post(lambda request: httpx.Response(503, text="busy"))

        def slow(request):
            raise httpx.ReadTimeout("slow", request=request)

        with pytest.raises(RewardHTTPError):
            _post(slow)
    by_level = {
        lvl: [r.getMessage() for r in caplog.records if r.levelno == lvl and r.name == "omni_async.reward.http_client"]
        for lvl in (logging.INFO, logging.WARNING)
    }
    assert by_level[logging.INFO] == [
        "POST http://scorer:1/v1/score answered after 1 retries (0 more since the last report)"
    ]
    exhausted = [m for m in by_level[logging.WARNING] if "retries exhausted" in m]
    assert len(exhausted) == 1 and "HTTP 503" in exhausted[0], by_level
    timeouts = [m for m in by_level[logging.WARNING] if "timed out" in m]
    assert len(timeouts) == 1 and "ReadTimeout" in timeouts[0], by_level


@ray.remote
def _worker_logging() -> tuple[str, bool]:
    pkg = logging.getLogger("omni_async")
    return logging.getLevelName(pkg.level), any(getattr(h, "_omni_async", False) for h in pkg.handlers)


def test_the_level_reaches_the_ray_workers(fresh_logger):
    """trainer.log_level=DEBUG on the driver: a Ray worker of the job has the package logger at DEBUG, with the
    handler, before any project code ran in it (the process setup hook configured it)."""
    shutdown_ray()
    try:
        init_ray(compose(["data.train_files=x.jsonl", "trainer.log_level=DEBUG"]), num_gpus=0, num_cpus=4)
        assert ray.get(_worker_logging.remote(), timeout=120) == ("DEBUG", True)
    finally:
        shutdown_ray()
