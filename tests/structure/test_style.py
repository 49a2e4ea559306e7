"""The repository stays `ruff check` and `ruff format` clean (pyproject's `[tool.ruff]`), so CI, which runs the
README's test command, catches a lint or formatting slip. ruff is pinned in requirements/constraints-cpu.txt: a
different ruff version may format differently."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
    exe = Path(sys.executable).with_name("ruff")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: `pip install -c requirements/constraints-cpu.txt -e '.[dev]'`")
    return [found]


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff_clean(args: list[str]) -> None:
    proc = subprocess.run([*_ruff(), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (
        f"`ruff {' '.join(args)}` failed; run `ruff {args[0]} .` (format: `ruff format .`) and commit:\n"
        f"{proc.stdout[-3000:]}{proc.stderr[-2000:]}"
    )
