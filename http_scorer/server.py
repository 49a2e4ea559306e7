"""The scorer service: FastAPI app with protocol v1 (JSON, or one raw image per request), optional flow_grpo pickle
compatibility, batching onto ``--workers`` scorer processes fed from one queue (pool.py), limits, a server-wide
budget of decoded pixels in flight (503 + Retry-After past it), bearer auth and Prometheus metrics. Built by
:func:`create_app`; served by ``python -m http_scorer serve``.

One HTTP process serves every request; the scorer processes decode and score. ``/metrics`` is the HTTP process's
metrics and the scorer processes' merged (metrics.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import pickle
import time
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from http_scorer.batcher import Batcher
from http_scorer.budget import PixelBudget, TooLarge, default_inflight_pixels
from http_scorer.metrics import ServerMetrics
from http_scorer.pool import ScorerPool
from http_scorer.protocol import (
    PROTOCOL_VERSION,
    BadRequest,
    Limits,
    Planned,
    ScoreRequest,
    ScoreResponse,
    check_counts,
    plan_images,
    plan_request,
)
from omni_async.reward.safe_pickle import UnsafePickleError, safe_loads

# Paths get their own metric label; anything else is counted as "other" (a scanner cannot grow the label set).
ROUTES = ("/v1/score", "/v1/score/image", "/", "/health", "/metrics", "/docs", "/openapi.json")
PUBLIC = ("/health", "/metrics", "/docs", "/openapi.json")  # no token needed, not counted as requests
IMAGE_TYPES = {"image/png": "png", "image/jpeg": "jpeg"}


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
    workers: int = 1  # scorer processes, fed from one queue (pool.py)

    def limits(self) -> Limits:
        return Limits(self.max_body_bytes, self.max_images, self.max_pixels)


def _error(status: int, message: str, field: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "field": field}, status_code=status, headers=headers)


class _Busy(Exception):
    """The pixel budget stayed full for the whole wait: 503 with Retry-After."""


class ScorerFailed(Exception):
    """The scorer raised, broke its contract, or its process died: 500 with the message."""


class _BodyTooLarge(Exception):
    pass


class Gate:
    """ASGI middleware, outermost: bearer token, body size (refused while it streams in: a missing or lying
    Content-Length cannot make the server buffer more), request / error counts and latency by route."""

    def __init__(self, app, config: ServerConfig, metrics: ServerMetrics):
        self.app, self.config, self.metrics = app, config, metrics
        self.expected = f"Bearer {config.token}".encode() if config.token is not None else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in ROUTES else "other"
        public = path in PUBLIC
        status = 500
        t0 = time.perf_counter()

        async def send_counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if not public:
                self.metrics.requests.labels(route).inc()
            headers = dict(scope.get("headers") or [])
            if (
                not public
                and self.expected is not None
                and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
            ):
                return await _error(
                    401,
                    "authorization: missing or wrong bearer token; send 'Authorization: Bearer <token>'",
                    "authorization",
                )(scope, receive, send_counted)
            limit = self.config.max_body_bytes
            too_big = _error(413, f"body: larger than the server's limit of {limit} bytes", "body")
            declared = headers.get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                return await too_big(scope, receive, send_counted)
            seen = 0

            async def limited_receive():
                nonlocal seen
                message = await receive()
                if message["type"] == "http.request":
                    seen += len(message.get("body", b""))
                    if seen > limit:
                        raise _BodyTooLarge
                return message

            try:
                await self.app(scope, limited_receive, send_counted)
            except _BodyTooLarge:
                await too_big(scope, receive, send_counted)
        finally:
            if status >= 400:
                self.metrics.errors.labels(str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - t0)


def create_app(config: ServerConfig | None = None, pool: ScorerPool | None = None) -> FastAPI:
    """The app; ``pool``: scorer processes already started (the CLI starts them first, so a scorer that cannot
    load stops the server with its message); without one, the app starts its own at startup."""
    config = config or ServerConfig()
    limits = config.limits()
    own_pool = pool is None
    pool = pool or ScorerPool(config.scorer, config.workers, limits)
    metrics = ServerMetrics(lambda: pool.metrics_dir)
    budget = PixelBudget(config.max_inflight_pixels or default_inflight_pixels())

    def on_batch(size: int, seconds: float) -> None:
        metrics.batch_size.observe(size)
        metrics.batch_seconds.observe(seconds)
        metrics.queue_depth.set(batcher.queue_depth())
        metrics.restarts.set(pool.restarts)

    batcher = Batcher(pool, config.max_batch, config.max_wait_ms, on_batch)

    @asynccontextmanager
    async def lifespan(app):
        if own_pool:
            await asyncio.get_running_loop().run_in_executor(None, pool.start)
        batcher.start()
        try:
            yield
        finally:
            await batcher.stop()
            pool.stop()  # here, not only in the CLI: uvicorn re-raises SIGTERM after shutdown, skipping finally

    app = FastAPI(
        title="omni_async scorer server",
        version="1",
        lifespan=lifespan,
        description="Scores images (OCR, JPEG, ...) for RL training. Protocol v1: POST /v1/score (JSON) "
        "or POST /v1/score/image (one raw PNG / JPEG).",
    )
    app.add_middleware(Gate, config=config, metrics=metrics)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        field = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or "body"
        return _error(422, f"{field}: {first.get('msg', 'invalid request')}; see /docs for protocol v1", field)

    def max_side() -> int | None:
        return pool.info.max_side if pool.info else None

    def wants_target() -> bool:
        return bool(pool.info and pool.info.needs_target)

    async def score_planned(plan: Planned, prompts, targets, metadata) -> list[tuple[float, dict]]:
        """Reserve the plan's pixels (waiting at most ``inflight_wait_s``), score it on the scorer processes, give
        the pixels back once no scorer process holds them. Raises BadRequest (413 when it could never fit, or a
        corrupt image), _Busy (503), TimeoutError, ScorerFailed (500)."""
        try:
            granted = await budget.acquire(plan.peak_pixels, config.inflight_wait_s)
        except TooLarge:
            raise BadRequest(
                "images",
                f"images: this request needs {plan.peak_pixels} pixels in flight (its images "
                "at the scorer's input size plus its largest image while it decodes); the "
                f"server's budget is {budget.capacity}; split the request or start the "
                "server with a larger --max-inflight-pixels",
                status=413,
            ) from None
        if not granted:
            metrics.busy.inc()
            raise _Busy
        metrics.inflight_pixels.set(budget.used)

        def give_back(_=None) -> None:
            budget.release(plan.peak_pixels)
            metrics.inflight_pixels.set(budget.used)

        items = batcher.submit(plan.items, prompts, targets, metadata)
        plan.items = []  # the queue holds the bytes now, until their batch is sent
        metrics.queue_depth.set(batcher.queue_depth())
        try:
            outcomes = await asyncio.wait_for(batcher.results(items), config.request_timeout_s)
        except BaseException:  # timeout or cancel: items still in a scorer process keep their pixels reserved
            batcher.withdraw(items)
            asyncio.ensure_future(batcher.settled(items)).add_done_callback(give_back)
            raise
        give_back()
        for outcome in outcomes:
            if outcome[0] == "bad":
                raise BadRequest(outcome[1], outcome[2], status=outcome[3])
        for outcome in outcomes:
            if outcome[0] == "error":
                raise ScorerFailed(outcome[1])
        return [(o[1], o[2]) for o in outcomes]

    def busy_message() -> str:
        return (
            f"server busy: the budget of {budget.capacity} decoded pixels in flight stayed full for "
            f"{config.inflight_wait_s:g}s ({budget.waiting()} requests waiting); retry after "
            f"{config.retry_after_s}s"
        )

    def missing_target(field: str) -> BadRequest:
        return BadRequest(
            field,
            f"{field}: the {config.scorer} scorer needs the target text of every image; send "
            "it in ground_truths (one string per image) or quote it in the prompt "
            '(a sign that says "HELLO")',
            status=422,
        )

    async def answer_json(plan_fn, prompts, targets, metadata, target_field) -> Response:
        """Plan (headers only: nothing is decoded before the budget admits it), check targets, score; every
        failure becomes a JSON error naming its field."""
        retry = {"Retry-After": str(config.retry_after_s)}
        try:
            plan = plan_fn()
            if wants_target():
                for i, prompt in enumerate(prompts):
                    targets[i] = (targets[i] if targets[i] and str(targets[i]).strip() else None) or _quoted(prompt)
                    if not targets[i]:
                        raise missing_target(target_field(i))
            results = await score_planned(plan, prompts, targets, metadata)
        except BadRequest as e:
            return _error(e.status, str(e), e.field)
        except _Busy:
            return _error(503, busy_message(), None, retry)
        except asyncio.TimeoutError:
            return _error(
                504,
                f"scoring took longer than the server's request timeout of "
                f"{config.request_timeout_s:g}s; retry or send fewer images",
            )
        except ScorerFailed as e:
            return _error(500, str(e))
        return JSONResponse(
            {
                "protocol_version": PROTOCOL_VERSION,
                "scores": [s for s, _ in results],
                "details": [d for _, d in results],
            }
        )

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "scorer": config.scorer,
            "protocol_version": PROTOCOL_VERSION,
            "flow_grpo_pickle": config.allow_flow_grpo_pickle,
            "workers": config.workers,
            "scorer_process_restarts": pool.restarts,
            "inflight_pixels": budget.used,
            "max_inflight_pixels": budget.capacity,
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.restarts.set(pool.restarts)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/score", response_model=ScoreResponse)
    async def score_v1(req: ScoreRequest):
        targets: list[Any] = list(req.ground_truths or [None] * len(req.prompts))
        return await answer_json(
            lambda: plan_request(req, limits, max_side()),
            req.prompts,
            targets,
            req.metadata,
            lambda i: f"ground_truths[{i}]" if req.ground_truths else "ground_truths",
        )

    @app.post("/v1/score/image", response_model=ScoreResponse)
    async def score_image(
        request: Request, prompt: str = "", ground_truth: str | None = None, metadata: str | None = None
    ):
        """One image as the raw body (``Content-Type: image/png`` or ``image/jpeg``): no base64, no JSON around
        it. ``prompt``, ``ground_truth`` and ``metadata`` (a JSON object) are query parameters."""
        fmt = IMAGE_TYPES.get(request.headers.get("content-type", "").split(";")[0].strip().lower())
        if fmt is None:
            return _error(
                415,
                "content-type: send the image bytes as the body with Content-Type image/png or "
                "image/jpeg (or JSON to POST /v1/score)",
                "content-type",
            )
        try:
            meta = json.loads(metadata) if metadata else {}
        except ValueError:
            meta = None
        if not isinstance(meta, dict):
            return _error(400, "metadata: must be a JSON object (URL-encoded in the query)", "metadata")
        body = await request.body()
        if not body:
            return _error(400, "body: empty; send the encoded image", "body")
        return await answer_json(
            lambda: plan_images([(body, fmt, "body")], limits, max_side()),
            [prompt],
            [ground_truth],
            meta,
            lambda i: "ground_truth",
        )

    @app.post("/", include_in_schema=False)
    async def score_flow_grpo(request: Request):
        """flow_grpo / verl-omni clients: pickled {images: [jpeg bytes], prompts, metadata} -> pickled {scores}.

        The target text of image i: ``metadata["ground_truths"][i]`` if given, else the text in double quotes in
        its prompt (flow_grpo: 'a sign that says "HELLO"'), else the whole prompt (verl-omni's client sends the
        sample's bare ``ground_truth`` as the prompt)."""
        if not config.allow_flow_grpo_pickle:
            return _error(
                403,
                "the flow_grpo pickle route is off; start the server with --allow-flow-grpo-pickle "
                "(requests are then read with a restricted unpickler) or use POST /v1/score (JSON)",
            )
        body = await request.body()

        def fail(status: int, message: str, headers: dict | None = None) -> Response:
            return Response(
                pickle.dumps({"error": message}),
                status_code=status,
                headers=headers,
                media_type="application/octet-stream",
            )

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
            plan = plan_images(
                [
                    (b, "jpeg" if b[:2] == b"\xff\xd8" else "png", f"images[{i}]")
                    if isinstance(b, bytes)
                    else _not_bytes(i)
                    for i, b in enumerate(raw_images)
                ],
                limits,
                max_side(),
            )
            del raw_images, payload
            targets = [_target(given[i] if given else None, str(p)) for i, p in enumerate(prompts)]
            if wants_target():
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
        except ScorerFailed as e:
            return fail(500, str(e))
        return Response(
            pickle.dumps({"scores": [s for s, _ in results], "details": [d for _, d in results]}),
            media_type="application/octet-stream",
        )

    app.state.config = asdict(config)
    app.state.pool = pool
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
