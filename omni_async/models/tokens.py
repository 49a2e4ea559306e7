"""Token-id helpers the text policies and the text modality share: padding rows of ids into a batch, and the EOS
ids a response stops at."""

from __future__ import annotations

from typing import Any

import torch


def pad_rows(rows: list[list[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of token ids as one ``[B, L]`` batch and its attention mask (1 = token, 0 = padding), on the CPU.

    ``left``: prompts end at the same column (generation appends after them), else responses start at the same
    column. ``L`` is the longest row, and at least 1, so a batch of empty responses still has a column."""
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        cols = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, cols], mask[i, cols] = torch.tensor(r, dtype=torch.long), 1
    return ids, mask


def eos_ids(generation_eos: int | list[int] | None, tokenizer: Any) -> list[int]:
    """The ids a response stops at: ``generation_config.eos_token_id``, an int or a list (Qwen2.5 / Qwen3-Instruct:
    ``[<|im_end|>, <|endoftext|>]``: a response stops at the first of any of them); the tokenizer's EOS when the
    generation config names none; ``[]`` when neither does."""
    eos = generation_eos if generation_eos is not None else tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
