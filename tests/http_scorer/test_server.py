"""The scorer server over real HTTP on loopback: protocol v1, flow_grpo pickle compatibility, auth, limits,
a pickle gadget, fuzzing, and batching under 200 concurrent requests."""

from __future__ import annotations

import asyncio
import base64
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scorer_server_helpers import BLANK, b64, encode, text_image

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def ocr_server(server_factory):
    return server_factory("--scorer", "ocr", "--allow-flow-grpo-pickle")


@pytest.fixture(scope="module")
def limited_server(server_factory):
    return server_factory(
        "--scorer",
        "sleep",
        "--token",
        TOKEN,
        "--max-images",
        "4",
        "--max-body-bytes",
        "300000",
        "--max-pixels",
        "1000000",
        "--max-batch",
        "16",
        "--max-wait-ms",
        "20",
    )


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_v1_ocr_round_trip(ocr_server, no_network):
    body = {
        "images": [
            b64(text_image("HELLO 42")),
            b64(BLANK),
            b64(text_image("HELLO 42"), "jpeg"),
            [b64(text_image("HELLO 42")), b64(BLANK)],
        ],
        "prompts": ["p"] * 4,
        "ground_truths": ["HELLO 42"] * 4,
    }
    r = httpx.post(f"{ocr_server.url}/v1/score", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["protocol_version"] == "1" and len(out["scores"]) == 4
    hello, blank, hello_jpeg, video = out["scores"]
    assert hello > 0.8 and hello_jpeg > 0.8 and blank == 0.0
    assert video == pytest.approx(hello / 2)  # mean over frames
    assert "42" in out["details"][0]["ocr_text"]
    # ocr reads one image per call (its max_batch is 1): the 4 items went one by one, whatever --max-batch says
    text = httpx.get(f"{ocr_server.url}/metrics").text
    calls = float(re.search(r"^scorer_batch_size_count (\S+)", text, re.M).group(1))
    assert calls >= 4 and float(re.search(r"^scorer_batch_size_sum (\S+)", text, re.M).group(1)) == calls
    spec = httpx.get(f"{ocr_server.url}/openapi.json").json()
    assert "/v1/score" in spec["paths"]


def test_raw_image_route_scores_without_base64_and_refuses_bad_input(ocr_server, limited_server):
    url = f"{ocr_server.url}/v1/score/image"
    jpeg = encode(text_image("HELLO 42"), "jpeg")
    r = httpx.post(
        url,
        params={"prompt": "a sign", "ground_truth": "HELLO 42"},
        content=jpeg,
        headers={"content-type": "image/jpeg"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert (
        r.json()["protocol_version"] == "1"
        and r.json()["scores"][0] > 0.8
        and "42" in r.json()["details"][0]["ocr_text"]
    )
    png = encode(BLANK)
    r = httpx.post(
        url,
        params={"prompt": 'a sign that says "HELLO 42"'},
        content=png,
        headers={"content-type": "image/png"},
        timeout=60,
    )  # the quoted prompt is the target
    assert r.status_code == 200 and r.json()["scores"] == [0.0]

    def err(content, ctype="image/png", **params):
        r = httpx.post(
            url, params={"ground_truth": "x", **params}, content=content, headers={"content-type": ctype}, timeout=60
        )
        return r.status_code, r.json()

    assert err(png, "application/octet-stream") == (
        415,
        {"error": err(png, "text/plain")[1]["error"], "field": "content-type"},
    )
    code, e = err(png, "image/jpeg")
    assert code == 400 and "declared format 'jpeg'" in e["error"] and e["field"] == "body"
    code, e = err(png[:40])
    assert code == 400 and e["field"] == "body" and "not a readable png" in e["error"]
    cut = encode(text_image("HELLO 42"))  # the header reads, the pixels end early: found by the scorer process
    code, e = err(cut[: len(cut) * 2 // 3])
    assert code == 400 and e["field"] == "body" and "truncated or corrupt" in e["error"]
    code, e = err(b"")
    assert code == 400 and e["field"] == "body"
    code, e = err(png, metadata="[1, 2]")
    assert code == 400 and e["field"] == "metadata"
    r = httpx.post(url, params={"prompt": "a sign"}, content=png, headers={"content-type": "image/png"})
    assert r.status_code == 422 and r.json()["field"] == "ground_truth"

    limited = f"{limited_server.url}/v1/score/image"
    small = encode(np.zeros((32, 32, 3), np.uint8))
    assert httpx.post(limited, content=small, headers={"content-type": "image/png"}).status_code == 401
    r = httpx.post(limited, content=small, headers={"content-type": "image/png", **AUTH})
    assert r.status_code == 200 and len(r.json()["scores"]) == 1
    r = httpx.post(limited, content=b"\x89PNG" + b"\0" * 400_000, headers={"content-type": "image/png", **AUTH})
    assert r.status_code == 413 and r.json()["field"] == "body"
    bomb = encode(np.zeros((2000, 2000, 3), np.uint8))
    r = httpx.post(limited, content=bomb, headers={"content-type": "image/png", **AUTH})
    assert r.status_code == 413 and "1000000 pixels" in r.json()["error"]


def test_flow_grpo_pickle_compat_and_gadget_refused(ocr_server, server_factory, tmp_path):
    req = {
        "images": [encode(text_image("HELLO 42"), "jpeg"), encode(BLANK, "jpeg")],
        "prompts": ['a sign that says "HELLO 42"'] * 2,
        "metadata": {},
    }
    r = httpx.post(ocr_server.url + "/", content=pickle.dumps(req), timeout=60)
    assert r.status_code == 200
    scores = pickle.loads(r.content)["scores"]
    assert scores[0] > 0.8 and scores[1] == 0.0

    marker = tmp_path / "pwned"

    class Gadget:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    r = httpx.post(ocr_server.url + "/", content=pickle.dumps({"images": [Gadget()], "prompts": ["x"]}))
    assert r.status_code == 400 and "only plain" in pickle.loads(r.content)["error"]
    assert not marker.exists()
    assert httpx.get(f"{ocr_server.url}/health").json()["status"] == "ok"

    off = server_factory("--scorer", "jpeg")
    r = httpx.post(off.url + "/", content=pickle.dumps(req))
    assert r.status_code == 403 and "--allow-flow-grpo-pickle" in r.json()["error"]


def test_auth_and_limits(limited_server):
    url = f"{limited_server.url}/v1/score"
    ok = {"images": [b64(np.zeros((32, 32, 3), np.uint8))], "prompts": ["p"]}
    assert httpx.post(url, json=ok).status_code == 401
    assert httpx.post(url, json=ok, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.post(url, json=ok, headers=AUTH).status_code == 200

    def err(body=None, content=None):
        r = httpx.post(url, json=body, content=content, headers=AUTH)
        return r.status_code, r.json()

    code, e = err({"images": [b64(np.zeros((8, 8, 3), np.uint8))] * 5, "prompts": ["p"] * 5})
    assert code == 413 and e["field"] == "images" and "limit of 4" in e["error"]
    bomb = encode(np.zeros((2000, 2000, 3), np.uint8))  # 4 Mpx of zeros: a few kB of PNG
    code, e = err({"images": [{"data": base64.b64encode(bomb).decode(), "format": "png"}], "prompts": ["p"]})
    assert code == 413 and "1000000 pixels" in e["error"] and e["field"] == "images[0].data"
    code, e = err(content=b"{" + b" " * 400_000 + b"}")
    assert code == 413 and e["field"] == "body"
    code, e = err({"images": [{"data": "not base64!", "format": "png"}], "prompts": ["p"]})
    assert code == 400 and "base64" in e["error"]
    png = encode(np.zeros((16, 16, 3), np.uint8))
    code, e = err({"images": [{"data": base64.b64encode(png[:40]).decode(), "format": "png"}], "prompts": ["p"]})
    assert code == 400 and e["field"] == "images[0].data"
    code, e = err({"images": [{"data": base64.b64encode(png).decode(), "format": "jpeg"}], "prompts": ["p"]})
    assert code == 400 and "declared format" in e["error"]
    code, e = err({"images": [b64(np.zeros((8, 8, 3), np.uint8))], "prompts": []})
    assert code == 400 and e["field"] == "prompts"
    code, e = err({"images": "x", "prompts": ["p"]})
    assert code == 422 and e["field"].startswith("images")


# JSON has no NaN / Infinity (httpx refuses to send them); broken JSON comes from the raw-bytes strategy.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
png_bytes = encode(np.zeros((8, 8, 3), np.uint8))
image_items = st.fixed_dictionaries(
    {
        "data": st.one_of(
            st.text(max_size=30),
            st.binary(max_size=60).map(lambda b: base64.b64encode(b).decode()),
            st.integers(0, len(png_bytes)).map(lambda k: base64.b64encode(png_bytes[:k]).decode()),
        ),
        "format": st.sampled_from(["png", "jpeg", "gif", 3]),
    }
)
bodies = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {
            "images": st.lists(st.one_of(image_items, st.lists(image_items, max_size=2)), max_size=6),
            "prompts": st.lists(st.text(max_size=10), max_size=6),
        },
        optional={"ground_truths": st.lists(st.text(max_size=5), max_size=6), "metadata": json_values},
    ),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, raw=st.one_of(st.none(), st.binary(max_size=200)), auth=st.booleans())
def test_fuzz_bad_requests_are_4xx_and_server_keeps_serving(limited_server, body, raw, auth):
    headers = AUTH if auth else {}
    if raw is not None:
        r = httpx.post(
            f"{limited_server.url}/v1/score", content=raw, headers={**headers, "content-type": "application/json"}
        )
    else:
        r = httpx.post(f"{limited_server.url}/v1/score", json=body, headers=headers)
    assert r.status_code < 500, (body, raw, r.status_code, r.text)
    if not auth:
        assert r.status_code == 401
    assert httpx.get(f"{limited_server.url}/health").status_code == 200


def test_200_concurrent_requests_are_batched(limited_server):
    img = b64(np.zeros((16, 16, 3), np.uint8))

    async def run():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        f"{limited_server.url}/v1/score",
                        json={"images": [img], "prompts": [str(i)], "metadata": {"sleep_s": 0.05}},
                        headers=AUTH,
                    )
                    for i in range(200)
                )
            )

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 200
    text = httpx.get(f"{limited_server.url}/metrics").text
    calls = float(re.search(r"^scorer_batch_size_count (\S+)", text, re.M).group(1))
    items = float(re.search(r"^scorer_batch_size_sum (\S+)", text, re.M).group(1))
    assert items >= 200 and calls < items / 4, (calls, items)  # batching: far fewer scorer calls than items
    assert 'scorer_errors_total{code="401"}' in text and "scorer_request_seconds_bucket" in text
    assert os.environ.get("HTTP_SCORER_CONFIG") is None  # the test process is untouched by the server's config


def scorer_process_gauge_pids(text: str) -> set[int]:
    """The pids of the per-process gauge scorer_process_resident_memory_bytes{pid="..."} in /metrics."""
    return {int(pid) for pid in re.findall(r'scorer_process_resident_memory_bytes\{pid="(\d+)"\} [1-9]', text)}


def test_worker_processes_share_one_queue_metrics_count_all_timeouts_and_crashes_are_survived(server_factory):
    stale = Path(tempfile.gettempdir()) / "http_scorer-metrics-999999999-left-by-a-killed-server"
    stale.mkdir(exist_ok=True)
    server = server_factory(
        "--scorer", "scorer_server_helpers:pid_scorer", "--workers", "2", "--max-batch", "1", "--request-timeout-s", "3"
    )
    # The server keeps its scorer processes' metric files in a directory of its own for this run, and removed the
    # one a server no longer running left behind.
    assert not stale.exists()
    (metrics_dir,) = Path(tempfile.gettempdir()).glob(f"http_scorer-metrics-{server.proc.pid}-*")
    url = f"{server.url}/v1/score"

    def body(**metadata):
        return {"images": [b64(np.zeros((8, 8, 3), np.uint8))], "prompts": ["p"], "metadata": metadata}

    # 4 clients, each request holding a scorer process 0.6 s: the one queue feeds both processes (whatever HTTP
    # connection a request came on), so they take 2 each and the 4 finish in about 2 x 0.6 s.
    async def four():
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=4)) as client:
            return await asyncio.gather(*(client.post(url, json=body(hold_s=0.6)) for _ in range(4)))

    responses = asyncio.run(four())
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    details = [r.json()["details"][0] for r in responses]
    pids = [d["pid"] for d in details]
    assert len(set(pids)) == 2 and max(pids.count(p) for p in pids) <= 3, pids
    # Never all behind one process: a batch of each process ran at the same time as one of the other's.
    assert any(
        a["pid"] != b["pid"] and a["start"] < b["end"] and b["start"] < a["end"] for a in details for b in details
    ), details
    # /metrics is the one HTTP process's, and it counted the batches of both scorer processes.
    text = httpx.get(f"{server.url}/metrics").text
    assert 'scorer_requests_total{route="/v1/score"} 4.0' in text
    assert "scorer_batch_size_count 4.0" in text and "scorer_batch_size_sum 4.0" in text
    # ... and the scorer processes' own metrics, merged (prometheus_client's multiprocess mode): items and stage
    # times summed over both processes, a memory / CPU gauge per scorer process.
    assert 'scorer_process_items_total{outcome="ok"} 4.0' in text, text
    assert 'scorer_process_seconds_count{stage="score"} 4.0' in text
    assert 'scorer_process_seconds_count{stage="decode"} 4.0' in text
    first_pids = scorer_process_gauge_pids(text)
    assert first_pids == set(pids), (first_pids, pids)
    assert len(re.findall(r'scorer_process_cpu_seconds\{pid="\d+"\} ', text)) == 2

    # A request past --request-timeout-s is answered 504 while its batch goes on; its pixels stay reserved until
    # the scorer process lets go of them.
    r = httpx.post(url, json=body(hold_s=4.0), timeout=30)
    assert r.status_code == 504 and "request timeout of 3s" in r.json()["error"]
    assert httpx.get(f"{server.url}/health").json()["inflight_pixels"] == 2 * 8 * 8
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.url}/health").json()["inflight_pixels"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(f"{server.url}/health").json()["inflight_pixels"] == 0

    # A scorer process that dies mid-batch fails that batch with 500 naming the exit code; it is started again
    # and the server keeps serving.
    r = httpx.post(url, json=body(crash=True), timeout=60)
    assert r.status_code == 500 and "exited (code 7)" in r.json()["error"] and "restarted" in r.json()["error"]
    assert [httpx.post(url, json=body(), timeout=60).status_code for _ in range(4)] == [200] * 4
    deadline = time.monotonic() + 60  # the restart happens after the answer, beside the other process's work
    while httpx.get(f"{server.url}/health").json()["scorer_process_restarts"] < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    health = httpx.get(f"{server.url}/health").json()
    assert health["scorer_process_restarts"] == 1 and health["workers"] == 2
    assert "scorer_process_restarts 1.0" in httpx.get(f"{server.url}/metrics").text
    # The dead process's counts stay in the sums (4 + the timed-out one + 4; the crashed batch never finished); its
    # gauges are gone and its successor's are there.
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(f"{server.url}/metrics").text
        now_pids = scorer_process_gauge_pids(text)
        if len(now_pids) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(now_pids) == 2 and len(now_pids & first_pids) == 1, (now_pids, first_pids)
    assert 'scorer_process_items_total{outcome="ok"} 9.0' in text, text

    server.stop()
    assert not metrics_dir.exists()  # removed when the server stops


def test_ocr_without_target_text_is_422_and_bare_ground_truth_is_the_target(ocr_server):
    url = f"{ocr_server.url}/v1/score"
    hello = b64(text_image("HELLO 42"))
    r = httpx.post(url, json={"images": [hello], "prompts": ["a sign"]}, timeout=60)
    assert r.status_code == 422 and r.json()["field"] == "ground_truths"
    assert "target text" in r.json()["error"] and "ground_truths" in r.json()["error"]
    r = httpx.post(
        url, json={"images": [hello, hello], "prompts": ["a sign"] * 2, "ground_truths": ["HELLO 42", " "]}, timeout=60
    )
    assert r.status_code == 422 and r.json()["field"] == "ground_truths[1]"
    # no ground truth, but the prompt quotes the target (flow_grpo's prompts): scored against it
    r = httpx.post(url, json={"images": [hello], "prompts": ['a sign that says "HELLO 42"']}, timeout=60)
    assert r.status_code == 200 and r.json()["scores"][0] > 0.8

    # verl-omni's client sends the sample's bare ground_truth as the prompt: it is the target text
    req = {
        "images": [encode(text_image("HELLO 42"), "jpeg"), encode(BLANK, "jpeg")],
        "prompts": ["HELLO 42", "HELLO 42"],
        "metadata": {},
    }
    r = httpx.post(ocr_server.url + "/", content=pickle.dumps(req), timeout=60)
    assert r.status_code == 200, pickle.loads(r.content)
    scores = pickle.loads(r.content)["scores"]
    assert scores[0] > 0.8 and scores[1] == 0.0
    # an explicit per-image target in metadata wins over the prompt
    req = {**req, "metadata": {"ground_truths": ["HELLO 42", "HELLO 42"]}, "prompts": ["x", 'says "nothing"']}
    assert (
        pickle.loads(httpx.post(ocr_server.url + "/", content=pickle.dumps(req), timeout=60).content)["scores"][0] > 0.8
    )
    r = httpx.post(ocr_server.url + "/", content=pickle.dumps({**req, "prompts": ["", "x"], "metadata": {}}))
    assert r.status_code == 422 and "prompts[0]" in pickle.loads(r.content)["error"]


def test_port_0_binds_a_port_the_os_picks_and_reports_it(server_factory):
    """``--port 0`` (what every server in these tests is started with): the server binds a free port and prints it
    on stdout; two servers get two ports, each serving at the port it reported."""
    a, b = server_factory("--scorer", "jpeg"), server_factory("--scorer", "jpeg")
    assert a.port != b.port and 0 not in (a.port, b.port)
    for server in (a, b):
        assert f"http_scorer listening on http://127.0.0.1:{server.port}\n" in server.output
        assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


@pytest.mark.parametrize("command", [["serve", "--help"], ["--help"]])
def test_help_shows_every_flag_with_help_text_and_its_default(command):
    from http_scorer.__main__ import build_parser

    out = subprocess.run(
        [sys.executable, "-m", "http_scorer", *command],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HTTP_SCORER_TOKEN": "from-env"},
    )
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps lines
    serve = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]
    flags = [a for a in serve._actions if a.dest != "help"]
    assert len(flags) >= 15
    for action in flags:
        assert action.help and len(action.help) > 10, action.option_strings
        flag = action.option_strings[0]
        shown = text.split(flag, 2)[-1].split(" --")[0]  # this flag's entry in the options list
        assert action.help.split()[0] in shown and "default" in shown, (flag, shown)
        if action.default not in (None, False):
            assert f"(default: {action.default})" in shown, (flag, shown)
    assert "from-env" not in out.stdout  # --help never prints the token
