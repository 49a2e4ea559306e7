"""Files a kill must never leave half-written: write a temporary file beside the target, flush and fsync it, rename
it over the target (atomic on POSIX), then fsync the directory so the rename itself survives a crash.

A checkpoint is complete when its ``trainer.json`` exists (``RLTrainer._checkpoints``); with every file of it
written this way, a kill at any instant leaves either the previous complete checkpoint or the new one, never a
``trainer.json`` that does not parse or an ``actor.pt`` cut short under a finished marker.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Call ``write(f)`` on a temporary binary file in ``path``'s directory, then make it ``path`` atomically."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_text_atomic(path: str | Path, text: str) -> None:
    """``Path.write_text`` that a kill cannot leave half-written."""
    write_atomic(path, lambda f: f.write(text.encode()))


def torch_save_atomic(obj: Any, path: str | Path) -> None:
    """``torch.save`` that a kill cannot leave half-written."""
    import torch

    write_atomic(path, lambda f: torch.save(obj, f))
