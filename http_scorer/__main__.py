"""``python -m http_scorer serve --scorer ocr --host 127.0.0.1 --port 19082 [options]`` (``--help`` lists them).

Once the port is bound the server prints ``http_scorer listening on http://HOST:PORT`` on stdout (flushed), so a
launcher that asks for ``--port 0`` (a free port the OS picks) reads the port it got from that line."""

from __future__ import annotations

import argparse
import os
import sys

from http_scorer.protocol import Limits

TOKEN_ENV = "HTTP_SCORER_TOKEN"


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)``; a flag whose default is None or off says its default in its own help."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m http_scorer", description="The omni_async scorer server.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve",
        formatter_class=_Help,
        help="run the scorer server",
        description="Serve a scorer over HTTP: POST /v1/score (JSON, base64 images), POST /v1/score/image (one raw "
        "PNG / JPEG), POST / (flow_grpo pickle, opt-in), GET /health, GET /metrics, GET /docs.",
    )
    s.add_argument(
        "--scorer", default="ocr", help="ocr (PP-OCR, flow_grpo's edit-distance rule) | jpeg | sleep | module:function"
    )
    s.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: every interface)")
    s.add_argument(
        "--port",
        type=int,
        default=19082,
        help="TCP port to listen on; 0: a free port picked by the OS. Either way, once bound, the server prints "
        "'http_scorer listening on http://HOST:PORT' on stdout",
    )
    s.add_argument(
        "--workers",
        type=int,
        default=1,
        help="scorer processes, fed batches from one queue (CPU scorers: one per core; GPU: one per GPU)",
    )
    s.add_argument(
        "--token",
        default=None,
        help=f"require 'Authorization: Bearer <token>' on scoring routes (default: ${TOKEN_ENV} if set, else no token)",
    )
    s.add_argument(
        "--max-batch", type=int, default=16, help="items per scorer call (at most the scorer's own max_batch: ocr 1)"
    )
    s.add_argument(
        "--max-wait-ms",
        type=float,
        default=10.0,
        help="how long the oldest waiting item waits for more to fill a batch",
    )
    s.add_argument(
        "--allow-flow-grpo-pickle",
        action="store_true",
        help="serve flow_grpo / verl-omni pickle clients on POST / (restricted unpickler; default: off, "
        "POST / answers 403)",
    )
    s.add_argument("--request-timeout-s", type=float, default=60.0, help="a request not scored by then is answered 504")
    s.add_argument(
        "--max-body-bytes",
        type=int,
        default=Limits.max_body_bytes,
        help="larger bodies are answered 413 (counted while they stream in)",
    )
    s.add_argument(
        "--max-images",
        type=int,
        default=Limits.max_images,
        help="images per request (a video counts its frames); more: 413",
    )
    s.add_argument(
        "--max-pixels",
        type=int,
        default=Limits.max_pixels,
        help="pixels per image, read from its header before decoding; more: 413",
    )
    s.add_argument(
        "--max-inflight-pixels",
        type=int,
        default=None,
        help="server-wide budget of decoded pixels in flight (default: min(MemAvailable/8, 2 GiB) / 12 "
        "bytes per pixel; see http_scorer/budget.py)",
    )
    s.add_argument(
        "--inflight-wait-s",
        type=float,
        default=2.0,
        help="how long a request waits for budget before it is answered 503",
    )
    s.add_argument("--retry-after-s", type=int, default=1, help="the Retry-After header of a 503")
    p.formatter_class = argparse.RawDescriptionHelpFormatter  # the epilog below is already formatted
    p.epilog = s.format_help()  # `python -m http_scorer --help` shows serve's flags and defaults too
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    import uvicorn

    from http_scorer.budget import default_inflight_pixels
    from http_scorer.pool import ScorerLoadError, ScorerPool
    from http_scorer.server import ServerConfig, create_app

    config = ServerConfig(
        scorer=args.scorer,
        token=args.token or os.environ.get(TOKEN_ENV) or None,
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        allow_flow_grpo_pickle=args.allow_flow_grpo_pickle,
        request_timeout_s=args.request_timeout_s,
        max_body_bytes=args.max_body_bytes,
        max_images=args.max_images,
        max_pixels=args.max_pixels,
        max_inflight_pixels=args.max_inflight_pixels or default_inflight_pixels(),
        inflight_wait_s=args.inflight_wait_s,
        retry_after_s=args.retry_after_s,
        workers=args.workers,
    )
    try:
        pool = ScorerPool(config.scorer, config.workers, config.limits())
        pool.start()  # the scorer loads here, so a bad --scorer stops the server with its message
    except (ValueError, ScorerLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        server = uvicorn.Config(create_app(config, pool), host=args.host, port=args.port, log_level="warning")
        sock = server.bind_socket()  # bound here, before serving, so the port (--port 0: the OS's pick) is known
        print(f"http_scorer listening on {listen_url(args.host, sock.getsockname()[1])}", flush=True)
        uvicorn.Server(server).run(sockets=[sock])
    finally:
        pool.stop()
    return 0


def listen_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


if __name__ == "__main__":
    sys.exit(main())
