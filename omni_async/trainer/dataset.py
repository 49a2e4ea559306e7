"""Prompt datasets in the verl / flow_grpo format, and a resumable batch sampler.

A row (jsonl line or parquet row) has:

- ``prompt``: a string, or verl's chat form ``[{"role": "user", "content": "..."}]`` (the last user turn is used);
- ``data_source``: a string naming the task (passed to reward functions);
- ``reward_model``: ``{"ground_truth": ..., "style": "rule"}`` (``ground_truth`` is required, may be ``""``);
- ``extra_info``: an optional dict (passed to reward functions unchanged);
- ``images``: input images to edit (verl's ``data.image_key`` column, image-editing models such as Qwen-Image-Edit):
  a list whose items are ``{"bytes": ...}`` (verl-omni's edit rows), ``{"path": ...}``, a path string or raw bytes, a
  path relative to the data file's directory. The prompt's user turn marks each with ``<image>``: verl-omni's
  ``"Picture 1: <image>Change the background to blue"`` (the ``Picture k: <image>`` markers are dropped from the
  prompt: the pipeline's template writes its own before the instruction).

A bad row raises :class:`DatasetError` with the file, the 1-based row number and the field.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from omni_async.sample import PromptRow


class DatasetError(ValueError):
    """A dataset row that cannot be used; the message names the file, row and field."""


def _prompt_text(value: Any, where: str) -> str:
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}: field 'prompt' is empty; give the text to generate from")
        return value
    if isinstance(value, (list, tuple, np.ndarray)) and len(value) > 0:
        users = [m for m in value if isinstance(m, dict) and m.get("role") == "user"]
        if users and isinstance(users[-1].get("content"), str):
            return users[-1]["content"]
    raise DatasetError(
        f"{where}: field 'prompt' must be a string or a list of chat messages with a user turn, "
        f"got {type(value).__name__}: {str(value)[:80]!r}"
    )


IMAGE_MARK = "<image>"
_PICTURE = re.compile(r"\s*Picture\s+\d+:\s*<image>")


def _image_bytes(item: Any, where: str, base: Path) -> bytes:
    """One ``images`` entry as encoded file bytes, decoded once here so that a bad image stops the run at start."""
    if isinstance(item, dict):
        item = item.get("bytes") or item.get("path")
    if isinstance(item, str):
        path = base / item
        if not path.is_file():
            raise DatasetError(f"{where}: image file {str(path)!r} not found (paths are relative to the data file)")
        item = path.read_bytes()
    if not isinstance(item, (bytes, bytearray)) or not item:
        raise DatasetError(
            f"{where}: expected {{'bytes': <encoded image>}}, {{'path': ...}}, a path or bytes, got "
            f"{type(item).__name__}: {str(item)[:60]!r}"
        )
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(item)) as img:
            img.load()
    except (UnidentifiedImageError, OSError) as e:
        raise DatasetError(f"{where}: not a decodable image ({e}); write PNG or JPEG bytes") from None
    return bytes(item)


def _edit_prompt(prompt: str, raw_images: Any, where: str, base: Path) -> tuple[str, tuple[bytes, ...]]:
    """The instruction without its ``Picture k: <image>`` markers, and the row's images (one per marker)."""
    if not isinstance(raw_images, (list, tuple, np.ndarray)) or len(raw_images) == 0:
        raise DatasetError(f"{where}: field 'images' must be a non-empty list of images, got {str(raw_images)[:60]!r}")
    images = tuple(_image_bytes(item, f"{where}: field 'images[{k}]'", base) for k, item in enumerate(raw_images))
    if prompt.count(IMAGE_MARK) != len(images):
        raise DatasetError(
            f"{where}: field 'prompt' marks {prompt.count(IMAGE_MARK)} input image(s) with {IMAGE_MARK!r} but "
            f"'images' has {len(images)}; write one 'Picture k: {IMAGE_MARK}' per image before the instruction"
        )
    text = _PICTURE.sub("", prompt, count=len(images)) if prompt.lstrip().startswith("Picture") else prompt
    if IMAGE_MARK in text:
        raise DatasetError(
            f"{where}: field 'prompt' has {IMAGE_MARK!r} inside the instruction ({prompt[:80]!r}); the pipeline puts "
            f"its images before it: start the user turn with 'Picture 1: {IMAGE_MARK}' ... and then the instruction"
        )
    if not text.strip():
        raise DatasetError(f"{where}: field 'prompt' has input images but no instruction")
    return text, images


def parse_row(raw: Any, where: str, base: Path = Path(".")) -> PromptRow:
    """Validate one raw record; ``where`` is ``"<file>:row <n>"`` for error messages, ``base`` the directory image
    paths are relative to."""
    if not isinstance(raw, dict):
        raise DatasetError(f"{where}: a row must be an object with 'prompt', 'data_source', 'reward_model'")
    if "prompt" not in raw:
        raise DatasetError(f"{where}: missing field 'prompt'")
    prompt = _prompt_text(raw["prompt"], where)
    data_source = raw.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        raise DatasetError(f"{where}: field 'data_source' must be a non-empty string, got {data_source!r}")
    rm = raw.get("reward_model")
    if not isinstance(rm, dict) or "ground_truth" not in rm:
        raise DatasetError(
            f"{where}: field 'reward_model.ground_truth' is missing; "
            'write {"reward_model": {"ground_truth": "...", "style": "rule"}} (use "" when there is none)'
        )
    extra = raw.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise DatasetError(f"{where}: field 'extra_info' must be an object, got {type(extra).__name__}")
    images: tuple[bytes, ...] = ()
    if raw.get("images") is not None:
        prompt, images = _edit_prompt(prompt, raw["images"], where, base)
    return PromptRow(
        prompt=prompt, data_source=data_source, ground_truth=rm["ground_truth"], extra_info=dict(extra), images=images
    )


def _read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:row {lineno}: not valid JSON ({e.msg} at column {e.colno})") from e


def _read_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    yield from enumerate(pq.read_table(path).to_pylist(), start=1)


def first_rows(rows: list[PromptRow], max_samples: int, otherwise: int | None = None) -> list[PromptRow]:
    """verl's ``data.{train,val}_max_samples``: the first ``max_samples`` rows (-1: all of them, or the first
    ``otherwise`` where given: validation's earlier cap, ``data.val_batch_size``)."""
    if max_samples >= 0:
        return rows[:max_samples]
    return rows if otherwise is None else rows[:otherwise]


def load_prompts(files: str | Sequence[str]) -> list[PromptRow]:
    """Read every row of the given ``.jsonl`` / ``.parquet`` files, validating each."""
    paths = [files] if isinstance(files, str) else list(files)
    rows: list[PromptRow] = []
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise DatasetError(f"{path}: file not found (data.train_files / data.val_files)")
        if path.suffix == ".jsonl":
            reader = _read_jsonl(path)
        elif path.suffix == ".parquet":
            reader = _read_parquet(path)
        else:
            raise DatasetError(f"{path}: unsupported extension {path.suffix!r}; use .jsonl or .parquet")
        rows.extend(parse_row(rec, f"{path}:row {n}", path.parent) for n, rec in reader)
    if not rows:
        raise DatasetError(f"{', '.join(map(str, paths))}: no rows")
    return rows


def check_prompt_lengths(
    rows: Sequence[PromptRow], max_length: int | None, count: Callable[[list[str]], list[int]]
) -> None:
    """verl's ``data.max_prompt_length`` with its default ``truncation=error``: a longer prompt stops the run at
    start. ``count`` gives each prompt's tokens as the modality counts them (``Modality.prompt_lengths``)."""
    if max_length is None:
        return
    lengths = count([r.prompt for r in rows])
    over = [(n, r.prompt) for n, r in zip(lengths, rows, strict=True) if n > max_length]
    if over:
        n, prompt = max(over)
        raise DatasetError(
            f"data.max_prompt_length={max_length}: {len(over)} prompt(s) are longer, the longest "
            f"{n} tokens: {prompt[:80]!r}. Fix: raise data.max_prompt_length (or null for no limit), "
            "or shorten / drop those prompts"
        )


class PromptSampler:
    """Endless batches of prompts, reshuffled every epoch, with a state that a checkpoint can restore exactly."""

    def __init__(self, rows: Sequence[PromptRow], batch_size: int, shuffle: bool = True, seed: int = 0):
        if batch_size > len(rows):
            raise DatasetError(
                f"data.train_batch_size={batch_size} is larger than the dataset ({len(rows)} rows); "
                "lower it or add prompts"
            )
        self.rows, self.batch_size, self.shuffle, self.seed = list(rows), batch_size, shuffle, seed
        self.epoch, self.position = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng((self.seed, self.epoch)).permutation(len(self.rows))

    def next_batch(self) -> list[PromptRow]:
        if self.position + self.batch_size > len(self.rows):
            self.epoch, self.position = self.epoch + 1, 0  # drop_last, like verl's dataloader
            self._order = self._make_order()
        idx = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return [self.rows[i] for i in idx]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._make_order()
