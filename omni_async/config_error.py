"""The error every config check raises, and the one way to raise it (the key, the problem, the fix)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config combination that cannot run; the message names the key and how to fix it."""


def check(ok: bool, key: str, problem: str, fix: str) -> None:
    """Raise :class:`ConfigError` naming ``key``, what is wrong and the fix, unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}: {problem}. Fix: {fix}")
