"""The scorer service: FastAPI app with protocol v1 (JSON), optional flow_grpo pickle compatibility, batching,
limits, a server-wide budget of decoded pixels in flight (503 + Retry-After past it), bearer auth and Prometheus
metrics. Built by :func:`create_app`; served by ``python -m http_scorer serve``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from http_scorer.batcher import Batcher
from http_scorer.budget import PixelBudget, TooLarge, default_inflight_pixels, return_freed_memory_to_os
from http_scorer.protocol import (
    BadRequest,
    Limits,
    Planned,
    ScoreRequest,
    ScoreResponse,
    check_counts,
    decode_planned,
    plan_images,
    plan_request,
)
from http_scorer.scorers import load_scorer, max_side, needs_target
from omni_async.reward.safe_pickle import UnsafePickleError, safe_loads

CONFIG_ENV = "HTTP_SCORER_CONFIG"  # how `--workers N` hands the config to each uvicorn worker process


@dataclass
class ServerConfig:
    scorer: str = "ocr"
    token: str | None = None
    max_batch: int = 16
    max_wait_ms: float = 10.0
    allow_flow_grpo_pickle: bool = False
    request_timeout_s: float = 60.0
    max_body_bytes: int = Limits.max_body_bytes
    max_images: int = Limits.max_images
    max_pixels: int = Limits.max_pixels
    max_inflight_pixels: int | None = None  # server-wide; None: default_inflight_pixels() (see budget.py)
    inflight_wait_s: float = 2.0  # how long a request waits for budget before its 503
    retry_after_s: int = 1  # the 503's Retry-After
    workers: int = 1  # processes sharing max_inflight_pixels (each gets its share)

    def limits(self) -> Limits:
        return Limits(self.max_body_bytes, self.max_images, self.max_pixels)


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("scorer_requests", "requests by route", ["route"], registry=self.registry)
        self.errors = Counter("scorer_errors", "error responses by status code", ["code"], registry=self.registry)
        self.batch_size = Histogram("scorer_batch_size", "items per scorer call", registry=self.registry,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self.batch_seconds = Histogram("scorer_batch_seconds", "seconds per scorer call", registry=self.registry)
        self.latency = Histogram("scorer_request_seconds", "request latency", ["route"], registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.queue_depth = Gauge("scorer_queue_depth", "items waiting for a scorer call", registry=self.registry)
        self.inflight_pixels = Gauge("scorer_inflight_pixels", "decoded pixels reserved by requests in flight",
                                     registry=self.registry)
        self.busy = Counter("scorer_busy_rejections", "requests answered 503: the pixel budget stayed full",
                            registry=self.registry)


def _error(status: int, message: str, field: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "field": field}, status_code=status, headers=headers)


class _Busy(Exception):
    """The pixel budget stayed full for the whole wait: 503 with Retry-After."""


class BodyLimit:
    """ASGI middleware: refuse a body past ``max_bytes`` while it streams in (a missing or lying Content-Length
    cannot make the server buffer more)."""

    def __init__(self, app, max_bytes: int, metrics: _Metrics):
        self.app, self.max_bytes, self.metrics = app, max_bytes, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = _error(413, f"body: larger than the server's limit of {self.max_bytes} bytes", "body")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            self.metrics.errors.labels("413").inc()
            return await too_big(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            self.metrics.errors.labels("413").inc()
            await too_big(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def create_app(config: ServerConfig | None = None) -> FastAPI:
    if config is None:  # a uvicorn worker process: the CLI left the config in the environment
        config = ServerConfig(**json.loads(os.environ[CONFIG_ENV]))
    scorer = load_scorer(config.scorer)
    side, wants_target = max_side(scorer), needs_target(scorer)
    metrics = _Metrics()
    limits = config.limits()
    total_budget = config.max_inflight_pixels or default_inflight_pixels()
    budget = PixelBudget(max(1, total_budget // max(1, config.workers)))
    return_freed_memory_to_os()
    # Decoding gets its own few threads: more would only add transient decode buffers and GIL contention with the
    # event loop (which must keep answering /health), not speed, on a CPU-bound step.
    decoder = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="decode")

    def on_batch(size: int, seconds: float) -> None:
        metrics.batch_size.observe(size)
        metrics.batch_seconds.observe(seconds)

    batcher = Batcher(scorer, config.scorer, config.max_batch, config.max_wait_ms, on_batch)

    @asynccontextmanager
    async def lifespan(app):
        batcher.start()
        yield
        await batcher.stop()
        decoder.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="omni_async scorer server", version="1", lifespan=lifespan,
                  description="Scores images (OCR, JPEG, ...) for RL training. Protocol v1: POST /v1/score.")
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, metrics=metrics)

    @app.middleware("http")
    async def auth_and_count(request: Request, call_next):
        route = request.url.path
        if route not in ("/health", "/metrics", "/docs", "/openapi.json"):
            metrics.requests.labels(route).inc()
            if config.token is not None:
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {config.token}".encode()):
                    metrics.errors.labels("401").inc()
                    return _error(401, "authorization: missing or wrong bearer token; send "
                                       "'Authorization: Bearer <token>'", "authorization")
        with metrics.latency.labels(route).time():
            response = await call_next(request)
        if response.status_code >= 400:
            metrics.errors.labels(str(response.status_code)).inc()
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        field = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or "body"
        return _error(422, f"{field}: {first.get('msg', 'invalid request')}; see /docs for protocol v1", field)

    async def run_scorer(images, prompts, ground_truths, metadata):
        metrics.queue_depth.set(batcher.queue_depth() + len(images))
        try:
            return await asyncio.wait_for(batcher.score(images, prompts, ground_truths, metadata),
                                          config.request_timeout_s)
        finally:
            metrics.queue_depth.set(batcher.queue_depth())

    async def score_planned(plan: Planned, prompts, targets, metadata):
        """Reserve the plan's pixels (waiting at most ``inflight_wait_s``), decode, score, give the pixels back.
        Raises BadRequest (413 when it could never fit), _Busy (503), TimeoutError, TypeError."""
        try:
            granted = await budget.acquire(plan.peak_pixels, config.inflight_wait_s)
        except TooLarge:
            raise BadRequest("images", f"images: this request needs {plan.peak_pixels} pixels in flight (its images "
                                       "at the scorer's input size plus its largest image while it decodes); the "
                                       f"server's budget is {budget.capacity}; split the request or start the "
                                       "server with a larger --max-inflight-pixels", status=413) from None
        if not granted:
            metrics.busy.inc()
            raise _Busy
        held = plan.peak_pixels
        metrics.inflight_pixels.set(budget.used)
        try:
            decoding = asyncio.get_running_loop().run_in_executor(decoder, decode_planned, plan, side)
            try:
                images = await asyncio.shield(decoding)
            except asyncio.CancelledError:  # the thread keeps decoding: its pixels stay reserved until it ends
                decoding.add_done_callback(lambda _f, n=held: budget.release(n))
                held = 0
                raise
            budget.release(held - plan.kept_pixels)  # the full-size decode buffer is gone
            held = plan.kept_pixels
            metrics.inflight_pixels.set(budget.used)
            try:
                return await run_scorer(images, prompts, targets, metadata)
            finally:
                del images  # the last reference this request holds to its decoded arrays
        finally:
            budget.release(held)
            metrics.inflight_pixels.set(budget.used)

    def busy_message() -> str:
        return (f"server busy: the budget of {budget.capacity} decoded pixels in flight stayed full for "
                f"{config.inflight_wait_s:g}s ({budget.waiting()} requests waiting); retry after "
                f"{config.retry_after_s}s")

    def missing_target(field: str) -> BadRequest:
        return BadRequest(field, f"{field}: the {config.scorer} scorer needs the target text of every image; send "
                                 "it in ground_truths (one string per image) or quote it in the prompt "
                                 '(a sign that says "HELLO")', status=422)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "scorer": config.scorer, "protocol_version": "1",
                "flow_grpo_pickle": config.allow_flow_grpo_pickle, "inflight_pixels": budget.used,
                "max_inflight_pixels": budget.capacity}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/score", response_model=ScoreResponse)
    async def score_v1(req: ScoreRequest):
        retry = {"Retry-After": str(config.retry_after_s)}
        try:
            plan = plan_request(req, limits, side)  # headers only: nothing is decoded before the budget admits it
            targets: list[Any] = list(req.ground_truths or [None] * len(req.prompts))
            if wants_target:
                for i, prompt in enumerate(req.prompts):
                    targets[i] = (targets[i] if targets[i] and targets[i].strip() else None) or _quoted(prompt)
                    if not targets[i]:
                        raise missing_target(f"ground_truths[{i}]" if req.ground_truths else "ground_truths")
            results = await score_planned(plan, req.prompts, targets, req.metadata)
        except BadRequest as e:
            return _error(e.status, str(e), e.field)
        except _Busy:
            return _error(503, busy_message(), None, retry)
        except asyncio.TimeoutError:
            return _error(504, f"scoring took longer than the server's request timeout of "
                               f"{config.request_timeout_s:g}s; retry or send fewer images")
        except TypeError as e:  # the scorer broke its contract: a server-side error, said plainly
            return _error(500, f"scorer {config.scorer}: {e}")
        return ScoreResponse(scores=[s for s, _ in results], details=[d for _, d in results])

    @app.post("/", include_in_schema=False)
    async def score_flow_grpo(request: Request):
        """flow_grpo / verl-omni clients: pickled {images: [jpeg bytes], prompts, metadata} -> pickled {scores}.

        The target text of image i: ``metadata["ground_truths"][i]`` if given, else the text in double quotes in
        its prompt (flow_grpo: 'a sign that says "HELLO"'), else the whole prompt (verl-omni's client sends the
        sample's bare ``ground_truth`` as the prompt)."""
        if not config.allow_flow_grpo_pickle:
            return _error(403, "the flow_grpo pickle route is off; start the server with --allow-flow-grpo-pickle "
                               "(requests are then read with a restricted unpickler) or use POST /v1/score (JSON)")
        body = await request.body()

        def fail(status: int, message: str, headers: dict | None = None) -> Response:
            return Response(pickle.dumps({"error": message}), status_code=status, headers=headers,
                            media_type="application/octet-stream")

        try:
            payload = safe_loads(body)
        except UnsafePickleError as e:
            return fail(400, f"body: {e}")
        del body
        if not isinstance(payload, dict) or not isinstance(payload.get("images"), list):
            return fail(400, "body: expected a dict with 'images' (a list of JPEG bytes), 'prompts', 'metadata'")
        raw_images, prompts = payload["images"], payload.get("prompts") or [""] * len(payload["images"])
        metadata = payload.get("metadata") or {}
        if not isinstance(metadata, dict) or not isinstance(prompts, list) or len(prompts) != len(raw_images):
            return fail(400, "body: 'prompts' must be a list with one entry per image and 'metadata' a dict")
        metadata = dict(metadata)
        given = metadata.pop("ground_truths", None)  # per-item, so not part of the batch-wide metadata
        if given is not None and (not isinstance(given, list) or len(given) != len(raw_images)):
            return fail(400, "metadata.ground_truths: send one target text per image")
        try:
            check_counts(len(raw_images), len(raw_images), limits)
            plan = plan_images([(b, "jpeg" if b[:2] == b"\xff\xd8" else "png", f"images[{i}]")
                                if isinstance(b, bytes) else _not_bytes(i) for i, b in enumerate(raw_images)],
                               limits, side)
            del raw_images, payload
            targets = [_target(given[i] if given else None, str(p)) for i, p in enumerate(prompts)]
            if wants_target:
                for i, t in enumerate(targets):
                    if not t:
                        raise missing_target(f"metadata.ground_truths[{i}]" if given else f"prompts[{i}]")
            results = await score_planned(plan, [str(p) for p in prompts], targets, metadata)
        except BadRequest as e:
            return fail(e.status, str(e))
        except _Busy:
            return fail(503, busy_message(), {"Retry-After": str(config.retry_after_s)})
        except asyncio.TimeoutError:
            return fail(504, "scoring took longer than the server's request timeout")
        except TypeError as e:
            return fail(500, f"scorer {config.scorer}: {e}")
        return Response(pickle.dumps({"scores": [s for s, _ in results], "details": [d for _, d in results]}),
                        media_type="application/octet-stream")

    app.state.config = asdict(config)
    return app


def _quoted(prompt: str) -> str | None:
    """flow_grpo's OCR prompts carry the target text in double quotes: 'a sign that says "HELLO 42"'."""
    parts = str(prompt).split('"')
    return parts[1] if len(parts) >= 3 and parts[1].strip() else None


def _target(given: Any, prompt: str) -> str | None:
    """The pickle route's target: the given text, else the quoted text in the prompt, else the bare prompt."""
    if given is not None and str(given).strip():
        return str(given)
    return _quoted(prompt) or (prompt if prompt.strip() else None)


def _not_bytes(i: int):
    raise BadRequest(f"images[{i}]", f"images[{i}]: expected encoded image bytes")
