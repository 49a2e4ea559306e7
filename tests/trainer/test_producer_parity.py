"""The parity guard of the one producer: for the same seed, today's step loop (every mode a setting of the rollouter)
gives the samples, versions, rewards, advantages and weights that the step loop of the separate mode strategies gave
(``parity/*.json``, recorded with commit 4c1aa46 by ``parity_cases.py record``), to 1e-6 in fp32, after 3 steps
(text weights: to 2e-5, the old code's own run-to-run spread; see ``parity_cases.WEIGHT_TOL``). The four image cases
where a rollout batch repeats a prompt (sync and stream: hybrid_sync, hybrid_stream, split_sync, disaggregated_stream)
were recorded again after the rollout began encoding each distinct prompt once (``DiffusionPolicy.encode_once``): the
text encoder's batch shape changed, so its rounding did, which AdamW turns into different weights from the first
update on. Their samples, seeds and versions at every step and every float of step 0 equal 4c1aa46's recording, and
sync, stream, the split and the disaggregated layouts still give each other's samples and rewards step for step.

Four cases run here (on-policy streaming; one-step-off in the hybrid and disaggregated layouts; text one-step-off in
the split layout); ``python tests/trainer/parity_cases.py check`` runs all nine (sync and stream in each layout too).
"""

from __future__ import annotations

import json

import pytest
from parity_cases import HERE, WEIGHT_TOL, assert_close, fingerprint

pytestmark = pytest.mark.slow  # training runs: not in the fast tier


@pytest.mark.parametrize(
    "case", ["hybrid_stream", "hybrid_one_step_off", "disaggregated_one_step_off", "text_split_one_step_off"]
)
def test_the_producer_reproduces_the_recorded_modes(case, tmp_path):
    want = json.loads((HERE / "parity" / f"{case}.json").read_text())
    assert_close(fingerprint(case, tmp_path), want, weight_tol=WEIGHT_TOL.get(case, 1e-6))
