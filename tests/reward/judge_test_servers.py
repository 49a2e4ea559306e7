"""Real servers on loopback for the judge / HTTP-client tests: an OpenAI-compatible chat server backed by the tiny
VLM, with switchable failure modes, and a misbehaving scorer (503s, 400s, errors in 200 bodies, a pickle gadget)."""

from __future__ import annotations

import asyncio
import base64
import io
import pickle
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from PIL import Image


class Control:
    def __init__(self):
        self.mode = "ok"  # ok | fail_then_ok | busy_then_ok | slow_then_ok | bad_request | slow | error_body | gadget
        self.failures_left = 0
        self.retry_after = "1"  # busy_then_ok: the 503's Retry-After header
        self.calls = 0
        self.gadget_target = ""


class Gadget:
    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def make_app(control: Control, judge=None) -> FastAPI:
    app = FastAPI()

    async def misbehave():
        control.calls += 1
        if control.mode == "fail_then_ok" and control.failures_left > 0:
            control.failures_left -= 1
            return JSONResponse({"error": "overloaded"}, status_code=503)
        if control.mode == "busy_then_ok" and control.failures_left > 0:
            control.failures_left -= 1
            return JSONResponse({"error": "busy"}, status_code=503, headers={"Retry-After": control.retry_after})
        if control.mode == "slow_then_ok" and control.failures_left > 0:
            control.failures_left -= 1
            await asyncio.sleep(5)
        if control.mode == "bad_request":
            return JSONResponse({"error": "bad image"}, status_code=400)
        if control.mode == "slow":
            await asyncio.sleep(5)
        return None

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if (bad := await misbehave()) is not None:
            return bad
        body = await request.json()
        url = next(p["image_url"]["url"] for p in body["messages"][0]["content"] if p["type"] == "image_url")
        image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
        text = await asyncio.get_running_loop().run_in_executor(None, judge.transcribe, image)
        return {"choices": [{"message": {"role": "assistant", "content": text}}], "model": body["model"]}

    @app.post("/v1/score")
    async def score(request: Request):
        if (bad := await misbehave()) is not None:
            return bad
        body = await request.json()
        if control.mode == "error_body":
            return {"error": "scorer crashed"}
        return {"protocol_version": "1", "scores": [0.5] * len(body["images"]), "details": [{}] * len(body["images"])}

    @app.post("/")
    async def flow_grpo(request: Request):
        await request.body()
        control.calls += 1
        if control.mode == "gadget":
            return Response(pickle.dumps({"scores": [Gadget(control.gadget_target)]}))
        return Response(pickle.dumps({"scores": [0.25]}))

    return app


class ThreadServer:
    """uvicorn in a background thread of the test process, on a loopback port the OS picked: the socket is bound
    (port 0) here and handed to uvicorn, so no other process can take the port between choosing and serving it."""

    def __init__(self, app: FastAPI):
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        sock = config.bind_socket()
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self.server.started:
            raise RuntimeError(f"the test server on {self.url} did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
