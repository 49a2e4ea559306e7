"""``python -m http_scorer serve --scorer ocr --host 127.0.0.1 --port 19082 [options]``"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from http_scorer.server import CONFIG_ENV, ServerConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m http_scorer")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the scorer server")
    s.add_argument("--scorer", default="ocr", help="ocr | jpeg | sleep | module:function")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=19082)
    s.add_argument("--workers", type=int, default=1, help="server processes (for CPU scorers)")
    s.add_argument("--token", default=os.environ.get("HTTP_SCORER_TOKEN"),
                   help="require 'Authorization: Bearer <token>' (default: $HTTP_SCORER_TOKEN)")
    s.add_argument("--max-batch", type=int, default=16, help="items per scorer call")
    s.add_argument("--max-wait-ms", type=float, default=10.0, help="how long a batch waits for more items")
    s.add_argument("--allow-flow-grpo-pickle", action="store_true",
                   help="serve flow_grpo / verl-omni pickle clients on POST / (restricted unpickler)")
    s.add_argument("--request-timeout-s", type=float, default=60.0)
    s.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes)
    s.add_argument("--max-images", type=int, default=ServerConfig.max_images)
    s.add_argument("--max-pixels", type=int, default=ServerConfig.max_pixels)
    s.add_argument("--max-inflight-pixels", type=int, default=None,
                   help="server-wide budget of decoded pixels in flight, shared by the --workers processes "
                        "(default: min(MemAvailable/8, 2 GiB) / 12 bytes per pixel; see http_scorer/budget.py)")
    s.add_argument("--inflight-wait-s", type=float, default=ServerConfig.inflight_wait_s,
                   help="how long a request waits for budget before it is answered 503")
    s.add_argument("--retry-after-s", type=int, default=ServerConfig.retry_after_s,
                   help="the Retry-After header of a 503")
    args = p.parse_args(argv)

    import uvicorn

    from http_scorer.scorers import load_scorer

    config = ServerConfig(scorer=args.scorer, token=args.token, max_batch=args.max_batch,
                          max_wait_ms=args.max_wait_ms, allow_flow_grpo_pickle=args.allow_flow_grpo_pickle,
                          request_timeout_s=args.request_timeout_s, max_body_bytes=args.max_body_bytes,
                          max_images=args.max_images, max_pixels=args.max_pixels,
                          max_inflight_pixels=args.max_inflight_pixels, inflight_wait_s=args.inflight_wait_s,
                          retry_after_s=args.retry_after_s, workers=args.workers)
    if config.max_inflight_pixels is None:  # measured once, here, so every worker process gets the same share
        from http_scorer.budget import default_inflight_pixels

        config.max_inflight_pixels = default_inflight_pixels()
    try:
        load_scorer(config.scorer)  # fail here, with the message, not inside a worker process
    except (ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.environ[CONFIG_ENV] = json.dumps(asdict(config))
    uvicorn.run("http_scorer.server:create_app", factory=True, host=args.host, port=args.port,
                workers=args.workers, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
