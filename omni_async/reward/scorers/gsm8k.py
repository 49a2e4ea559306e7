"""GSM8K-style rule rewards for text mode, in verl's convention (``solution_str``).

``compute_score`` is verl's own GSM8K scorer (the answer after ``####``, strict format), reused as is. The
format reward ``compute_score_digits`` (share of digits in the response) is achievable by a random tiny LM,
which makes it the reward of the text learning test.
"""

from __future__ import annotations

from typing import Any


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
) -> float:
    """verl's ``gsm8k.compute_score``; its options (``method``, ``format_score``, ``score``) may be reward kwargs, at
    verl's defaults otherwise."""
    from verl.utils.reward_score import gsm8k

    options = {k: kwargs[k] for k in ("method", "format_score", "score") if k in kwargs}
    return float(gsm8k.compute_score(solution_str, str(ground_truth), **options))


def compute_score_digits(
    data_source: str, solution_str: str, ground_truth: Any = None, extra_info: dict | None = None, **kwargs
) -> float:
    """Share of the response's characters that are ASCII digits (0 for an empty response)."""
    return sum(c in "0123456789" for c in solution_str) / len(solution_str) if solution_str else 0.0
