"""The error every config check raises, and the one way to raise it (the key, the problem, the fix)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config combination that cannot run; the message names the key and how to fix it."""


class ConfigErrors(ConfigError):
    """Several problems found at once; ``problems`` holds one ``(key, message)`` each."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__(f"{len(problems)} problems stop this run:\n" + "\n".join(f"- {m}" for _, m in problems))


def check(ok: bool, key: str, problem: str, fix: str) -> None:
    """Raise :class:`ConfigError` naming ``key``, what is wrong and the fix, unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}: {problem}. Fix: {fix}")
