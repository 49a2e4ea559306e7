"""The GPU tier's set-up: its CPU twins' modules importable (their tests run here unchanged on the device), and the
fixtures those twins take (``trainers`` is the suite's, tests/conftest.py)."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# pytest puts a test's own folder on sys.path only when it collects that folder
for folder in ("trainer", "reward", "."):
    if str(TESTS / folder) not in sys.path:
        sys.path.insert(0, str(TESTS / folder))

from test_sync_trainer import data_dir  # noqa: E402, F401  (a twin's fixture: the OCR prompts)
