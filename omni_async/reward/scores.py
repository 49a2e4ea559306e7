"""The one score normaliser: what a reward function (``reward.manager``) or a scorer of the scorer server
(``http_scorer.scorers``) returns, as ``(score, extra)``.

Accepted: a finite number, a dict with a ``"score"`` key (its other keys are the extra info), or the
``(score, text, explanation)`` tuple of verl's async reward agent recipe. Standard library only: the scorer
server's own install (``packages/scorer``) ships this module without torch.
"""

from __future__ import annotations

import math
from typing import Any


class RewardFunctionError(TypeError):
    """A reward function returned something that is not a score."""


def normalize_result(name: str, result: Any, what: str = "reward function") -> tuple[float, dict[str, Any]]:
    """Map a return value to ``(score, extra_info)``, or raise naming ``what`` returned it (``what name``)."""
    extra: dict[str, Any] = {}
    score: Any = result
    if isinstance(result, dict):
        if "score" not in result:
            raise RewardFunctionError(
                f"{what} {name} returned a dict without 'score': keys "
                f"{sorted(result)[:8]}; return {{'score': float, ...}}"
            )
        score, extra = result["score"], {k: v for k, v in result.items() if k != "score"}
    elif isinstance(result, tuple) and len(result) == 3:
        score, text, explanation = result
        extra = {"judge_text": text, "judge_explanation": explanation}
    # bool is an int, but a True/False "score" is a bug in the function, not a reward of 1/0.
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(float(score)):
        raise RewardFunctionError(
            f"{what} {name} returned {type(result).__name__} {str(result)[:80]!r}; return a finite float, "
            "a dict with 'score', or a (score, text, explanation) tuple"
        )
    return float(score), extra
