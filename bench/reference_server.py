"""The common reference for a reward server, written for the comparison in ``bench/http_scorer.py --reference``.

What flow_grpo's (and ddpo-pytorch's) reward servers do: a Flask app under gunicorn *sync* workers, ``POST /`` with
a pickled ``{"images": [jpeg bytes], "prompts": [...], "metadata": {...}}``, one scorer call per request, the
pickled result back. The scorer is the same function the scorer server runs (``--scorer`` spec, e.g. ``ocr`` or
``bench.http_scorer:gpu_like_judge``), called with the request's decoded images.

Differences from the usual deployment, on purpose: the body is read with the project's restricted unpickler
(the same C unpickler with no global lookup: the same speed, but no code execution from the network -- DESIGN's
security rule holds even in the bench), and the target text of OCR is taken from ``metadata["ground_truths"]``.

Run (flask and gunicorn live in a bench-only directory, never in the project's dependencies)::

    PYTHONPATH=bench/.reference-deps:. python -m gunicorn -w 2 -b 127.0.0.1:PORT \
        'bench.reference_server:create_app(scorer="ocr")'
"""

from __future__ import annotations

import io
import pickle

import numpy as np
from flask import Flask, request
from PIL import Image

from http_scorer.scorers import load_scorer, normalize
from omni_async.reward.safe_pickle import UnsafePickleError, safe_loads


def create_app(scorer: str = "ocr") -> Flask:
    fn = load_scorer(scorer)
    app = Flask(__name__)

    @app.post("/")
    def inference():
        try:
            data = safe_loads(request.get_data())
            images = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in data["images"]]
            metadata = dict(data.get("metadata") or {})
            targets = metadata.pop("ground_truths", None) or [None] * len(images)
            results = normalize(fn(images, list(data["prompts"]), targets, metadata), len(images), scorer)
        except (UnsafePickleError, KeyError, TypeError, ValueError, OSError) as e:
            return pickle.dumps({"error": f"{type(e).__name__}: {e}"}), 400
        return pickle.dumps({"scores": [s for s, _ in results], "details": [d for _, d in results]})

    @app.get("/health")
    def health():
        return {"status": "ok"}

    return app
