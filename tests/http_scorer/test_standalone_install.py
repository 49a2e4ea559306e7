"""The scorer server from its own install (``packages/scorer``) in a clean venv: no torch, verl, Ray or diffusers
there, and it still serves real OCR over HTTP.

The dependencies are installed from wheels pinned by requirements/constraints-cpu.txt and cached under
``$OMNI_ASYNC_CACHE/scorer-wheels-<hash of the lock and the scorer's pyproject>`` (the first run fetches them from
PyPI, ~150 MB; later runs install offline from the cache). The scorer's own wheel is built from this checkout
every time. About 15-25 s here once the cache is filled, so it runs in the fast tier too.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from scorer_server_helpers import BLANK, b64, encode, launch, text_image, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements/constraints-cpu.txt"
PYPROJECT = ROOT / "packages/scorer/pyproject.toml"


def run(cmd, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kw)
    assert out.returncode == 0, f"{cmd}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def pip(*args, python: Path | None = None) -> list:
    return [
        sys.executable,
        "-m",
        "pip",
        "--disable-pip-version-check",
        *(["--python", python] if python else []),
        *args,
    ]


def dependency_wheels(scorer_wheel: Path) -> Path:
    key = hashlib.sha256(LOCK.read_bytes() + PYPROJECT.read_bytes()).hexdigest()[:12]
    cache = Path(os.environ.get("OMNI_ASYNC_CACHE", Path.home() / ".cache/omni_async")) / f"scorer-wheels-{key}"
    if not (cache / ".complete").exists():
        run(pip("wheel", "-q", "-w", cache, "-c", LOCK, scorer_wheel))
        for own in cache.glob("omni_async_scorer-*.whl"):  # always the fresh build, never a cached one
            own.unlink()
        (cache / ".complete").touch()
    return cache


@pytest.mark.slow  # a venv install: not in the fast tier (pytest -m 'not slow')
def test_scorer_server_runs_from_its_own_install_without_torch(tmp_path):
    run(
        pip(
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            tmp_path / "dist",
            ROOT / "packages/scorer",
        )
    )
    (scorer_wheel,) = (tmp_path / "dist").glob("omni_async_scorer-*.whl")
    wheels = dependency_wheels(scorer_wheel)

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin/python"
    run(
        pip(
            "install",
            "-q",
            "--no-compile",
            "--no-index",
            "--find-links",
            wheels,
            "-c",
            LOCK,
            scorer_wheel,
            python=python,
        )
    )

    # Nothing of the repository is importable there: no PYTHONPATH, and the commands run outside the checkout.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    probe = (
        "import importlib.util, json, http_scorer, omni_async.reward.scorers.ocr as ocr; print(json.dumps("
        "{'found': [m for m in ('torch', 'ray', 'verl', 'diffusers', 'transformers', 'omni_async.trainer') "
        "if importlib.util.find_spec(m)], 'at': [http_scorer.__file__, ocr.__file__]}))"
    )
    seen = json.loads(run([python, "-c", probe], cwd=tmp_path, env=env).stdout)
    assert seen["found"] == [], seen
    assert all(path.startswith(str(venv)) for path in seen["at"]), seen
    no_torch = subprocess.run([python, "-c", "import torch"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr

    server, url, output = launch(
        [venv / "bin/omni-async-scorer", "serve", "--scorer", "ocr", "--port", "0"],
        timeout_s=180,
        cwd=tmp_path,
        env=env,
    )
    try:
        wait_healthy(server, url, output, timeout_s=180)
        r = httpx.post(
            f"{url}/v1/score",
            json={
                "images": [b64(text_image("HELLO 42")), b64(BLANK)],
                "prompts": ["p", "p"],
                "ground_truths": ["HELLO 42"] * 2,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        hello, blank = r.json()["scores"]
        assert hello > 0.8 and blank == 0.0 and "42" in r.json()["details"][0]["ocr_text"]
        r = httpx.post(
            f"{url}/v1/score/image",
            params={"ground_truth": "HELLO 42"},
            content=encode(text_image("HELLO 42"), "jpeg"),
            headers={"content-type": "image/jpeg"},
            timeout=120,
        )
        assert r.status_code == 200 and r.json()["scores"][0] > 0.8, r.text
        # the scorer process's own metrics reach /metrics there too (prometheus_client's multiprocess mode)
        assert 'scorer_process_items_total{outcome="ok"} 3.0' in httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        server.terminate()
        server.wait(timeout=30)
