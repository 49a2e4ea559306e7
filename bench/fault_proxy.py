"""A loopback HTTP/1.1 fault proxy for the soak benchmark: plain asyncio streams in front, httpx to the upstream.

    .venv/bin/python bench/fault_proxy.py --upstream http://127.0.0.1:19082 --port 19083 \
        [--p-503 0.30 --p-hang 0.05 --p-reset 0.01 --hang-s 15 --retry-after 1 --seed 0]

Each request (read whole: head + ``Content-Length`` body) draws one fate from a seeded RNG, in this order:

- ``reset``  (``--p-reset``): the connection is closed with ``SO_LINGER 0``, so the client reads a TCP RST;
- ``hang``   (``--p-hang``): no answer for ``--hang-s`` seconds (longer than the client's timeout), then close;
- ``503``    (``--p-503``): ``503 Service Unavailable`` with ``Retry-After: --retry-after`` (omitted when < 0);
- otherwise forwarded to ``--upstream`` and its response relayed (keep-alive kept).

``GET /__proxy_stats`` (never faulted) answers the counts as JSON: requests, forwarded, 503, hang, reset, and
upstream errors (answered 502).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import struct

import httpx

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "upgrade", "te"}


class FaultProxy:
    def __init__(
        self, upstream: str, p_503: float, p_hang: float, p_reset: float, hang_s: float, retry_after: int, seed: int
    ):
        self.upstream = upstream.rstrip("/")
        self.p_503, self.p_hang, self.p_reset, self.hang_s = p_503, p_hang, p_reset, hang_s
        self.retry_after = retry_after
        self.rng = random.Random(seed)
        self.counts = {"requests": 0, "forwarded": 0, "503": 0, "hang": 0, "reset": 0, "upstream_error": 0}
        self.client: httpx.AsyncClient | None = None

    def fate(self) -> str:
        r = self.rng.random()
        if r < self.p_reset:
            return "reset"
        if r < self.p_reset + self.p_hang:
            return "hang"
        if r < self.p_reset + self.p_hang + self.p_503:
            return "503"
        return "forward"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = [tuple(x.strip() for x in ln.split(":", 1)) for ln in lines[1:] if ":" in ln]
                lower = {k.lower(): v for k, v in headers}
                body = await reader.readexactly(int(lower.get("content-length", 0) or 0))
                if target == "/__proxy_stats":
                    await self.respond(
                        writer, 200, {"content-type": "application/json"}, json.dumps(self.counts).encode()
                    )
                    continue
                self.counts["requests"] += 1
                fate = self.fate()
                if fate != "forward":
                    self.counts[fate] += 1
                if fate == "reset":
                    sock = writer.get_extra_info("socket")
                    if sock is not None:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                if fate == "hang":
                    await asyncio.sleep(self.hang_s)
                    return
                if fate == "503":
                    extra = {"retry-after": str(self.retry_after)} if self.retry_after >= 0 else {}
                    await self.respond(
                        writer,
                        503,
                        {"content-type": "application/json", **extra},
                        b'{"error": "fault proxy: injected 503"}',
                    )
                    continue
                fwd = {k: v for k, v in headers if k.lower() not in HOP_BY_HOP and k.lower() != "host"}
                try:
                    r = await self.client.request(method, self.upstream + target, headers=fwd, content=body)
                except httpx.HTTPError as e:
                    self.counts["upstream_error"] += 1
                    await self.respond(writer, 502, {"content-type": "text/plain"}, f"upstream: {e!r}".encode())
                    continue
                self.counts["forwarded"] += 1
                out = {k: v for k, v in r.headers.items() if k.lower() not in HOP_BY_HOP | {"content-encoding"}}
                await self.respond(writer, r.status_code, out, r.content)
                if lower.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            if not writer.transport.is_closing():
                writer.close()

    @staticmethod
    async def respond(writer: asyncio.StreamWriter, status: int, headers: dict[str, str], body: bytes) -> None:
        reason = {200: "OK", 502: "Bad Gateway", 503: "Service Unavailable"}.get(status, "Status")
        head = [
            f"HTTP/1.1 {status} {reason}",
            *(f"{k}: {v}" for k, v in headers.items()),
            f"content-length: {len(body)}",
            "connection: keep-alive",
        ]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        await writer.drain()

    async def serve(self, host: str, port: int) -> None:
        # httpx decodes compressed bodies: ask the upstream for none, so relayed bytes equal its payload.
        self.client = httpx.AsyncClient(
            timeout=None,
            headers={"accept-encoding": "identity"},
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )
        server = await asyncio.start_server(self.handle, host, port, backlog=512)
        print(f"fault proxy on http://{host}:{port} -> {self.upstream}", flush=True)
        async with server:
            await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--upstream", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--p-503", type=float, default=0.30)
    p.add_argument("--p-hang", type=float, default=0.05)
    p.add_argument("--p-reset", type=float, default=0.01)
    p.add_argument("--hang-s", type=float, default=15.0)
    p.add_argument("--retry-after", type=int, default=1, help="Retry-After seconds of a 503 (-1: none)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    proxy = FaultProxy(a.upstream, a.p_503, a.p_hang, a.p_reset, a.hang_s, a.retry_after, a.seed)
    asyncio.run(proxy.serve(a.host, a.port))


if __name__ == "__main__":
    main()
