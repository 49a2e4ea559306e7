"""Command-line overrides checked key by key before Hydra composes them.

Hydra stops at the first key it does not know with ``Could not override 'X'`` and nothing else. Users come here with
verl / verl-omni recipes, whose keys are partly this project's, partly engine knobs of engines this project does not
run, and partly features it does not have. Every override is looked at here first:

* a key of this project's config passes unchanged (``+key`` on a key that exists becomes ``++key``, since upstream
  adds with ``+`` keys its own config lacks and this one has; a key under an open mapping, with or without ``+``,
  becomes ``++key``, since upstream sets without ``+`` the ones its config names, e.g. nsys' ``trace``);
* a verl / verl-omni key listed in :mod:`omni_async.config.upstream_keys` is renamed to this project's spelling,
  accepted (meaning the same here, or logged once as having no effect here) or refused, value by value;
* any other key is refused naming the nearest keys that do exist.

All problems of one command line are raised together in one :class:`OverrideError`, so a recipe with three keys
this project refuses costs one try, not three.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
from typing import Any

from omegaconf import OmegaConf

from omni_async.config.schema import compose_untyped, parse
from omni_async.config.upstream_keys import RULES, Get, Rule
from omni_async.config_error import ConfigError

logger = logging.getLogger(__name__)


class OverrideError(ConfigError):
    """Overrides that cannot be used here; ``problems`` holds one ``(key, message)`` per key."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        if len(problems) == 1:
            text = problems[0][1]
        else:
            text = f"{len(problems)} overrides cannot be used here:\n" + "\n".join(f"- {m}" for _, m in problems)
        super().__init__(text)


def render(value: Any) -> str:
    """A parsed override value as Hydra override text."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value) if any(c in value for c in " ,[]{}()'\"=:$") else value
    return json.dumps(value)


@functools.cache
def _defaults(config_name: str) -> tuple[dict[str, Any], frozenset[str]]:
    """(every key of ``config_name`` -> its default, incl. sections; the open mappings users add keys to)."""
    flat: dict[str, Any] = {}
    open_maps: set[str] = set()

    def walk(node: Any, prefix: str) -> None:
        for k, v in node.items():
            key = f"{prefix}{k}"
            flat[key] = v
            if isinstance(v, dict):
                if not v:
                    open_maps.add(key)
                walk(v, f"{key}.")

    walk(OmegaConf.to_container(compose_untyped([], config_name), resolve=False), "")
    return flat, frozenset(open_maps)


def known(key: str, config_name: str) -> bool:
    flat, open_maps = _defaults(config_name)
    if key in flat:
        return True
    parts = key.split(".")
    return any(".".join(parts[:i]) in open_maps for i in range(1, len(parts)))


def nearest(key: str, config_name: str, n: int = 4) -> list[str]:
    """Keys of ``config_name`` closest to ``key``: the same last name first, then the closest spellings."""
    flat, _ = _defaults(config_name)
    leaves = [k for k, v in flat.items() if not isinstance(v, dict) or not v]
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in leaves if k.rsplit(".", 1)[-1] == leaf]
    close = difflib.get_close_matches(key, leaves, n=n, cutoff=0.6)
    return (same_leaf + [k for k in close if k not in same_leaf])[:n]


def _unknown(key: str, config_name: str) -> str:
    near = nearest(key, config_name)
    hint = f"the nearest keys are {', '.join(near)}" if near else "no key here is close to it"
    return (
        f"{key}: not a key of this project's config ({config_name}), nor a verl / verl-omni key it knows. Fix: check "
        f"the spelling; {hint} (every key: omni_async/config/{config_name}.yaml; upstream keys: "
        "docs/verl_omni_recipes.md)"
    )


def rule_key(key: str) -> str | None:
    """The entry of ``upstream_keys.RULES`` that covers ``key``: the key itself, or the nearest ``<prefix>.*``."""
    if key in RULES:
        return key
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if (pattern := ".".join(parts[:i]) + ".*") in RULES:
            return pattern
    return None


def rule_for(key: str) -> Rule | None:
    pattern = rule_key(key)
    return RULES[pattern] if pattern is not None else None


def _accepts(rule: Rule, value: Any, get: Get) -> bool:
    """``rule.accepts``, where a value of the wrong type (``lr_warmup_steps_ratio=abc``) is one it does not accept."""
    try:
        return bool(rule.accepts(value, get))
    except (TypeError, ValueError):
        return False


def check_overrides(overrides: list[str], config_name: str = "flowgrpo_trainer") -> list[str]:
    """The overrides Hydra should compose: ``overrides`` with upstream keys renamed, accepted ones dropped (logged
    where they have no effect), ``+`` on existing keys made ``++``. Raises :class:`OverrideError` listing every key
    that cannot be used, each with why and the fix."""
    parsed = parse(list(overrides))
    flat, _ = _defaults(config_name)
    given = {o.key_or_group: o.value() for o in parsed if not o.is_delete()}
    renamed_to: dict[str, tuple[str, Any]] = {}  # canonical -> (the upstream key, its value here)

    def get(key: str) -> Any:
        return given[key] if key in given else flat.get(key)

    kept: list[str] = []
    problems: list[tuple[str, str]] = []
    for o in parsed:
        key, line = o.key_or_group, o.input_line
        if key == "hydra" or key.startswith("hydra.") or known(key, config_name):
            if key not in flat and not o.is_delete() and not key.startswith("hydra"):
                # a key of an open mapping (nsight options, reward_kwargs): verl's config names some of them
                # (nsys' trace=...), so its recipes set them without the ``+`` a mapping empty here would need
                kept.append("++" + line.lstrip("+"))
            else:
                kept.append("+" + line if o.type.name == "ADD" and key in flat else line)
            continue
        rule = rule_for(key)
        if rule is None:
            problems.append((key, _unknown(key, config_name)))
            continue
        if o.is_delete():
            continue  # removing a key this project does not have: nothing to do
        value = o.value()
        text = line.split("=", 1)[1]
        if rule.kind == "renamed":
            new = rule.convert(value) if rule.convert else value
            canonical = rule.canonical
            if canonical in given and given[canonical] != new:
                problems.append(
                    (
                        key,
                        f"{key}: {canonical}={render(given[canonical])} and {key}={text} are one setting given "
                        f"twice with different values. Fix: give only one of them ({canonical} is this project's "
                        "spelling)",
                    )
                )
                continue
            if canonical in renamed_to and renamed_to[canonical][1] != new:
                other = renamed_to[canonical][0]
                problems.append(
                    (
                        key,
                        f"{key}: {other} and {key} both set {canonical}, to different values. Fix: give only one",
                    )
                )
                continue
            renamed_to[canonical] = (key, new)
            if canonical not in given:
                kept.append(f"++{canonical}={render(new) if rule.convert else text}")
            continue
        if rule.kind == "refused" or (rule.accepts is not None and not _accepts(rule, value, get)):
            problems.append((key, f"{key}={text}: {rule.why}. Fix: {rule.fix}"))
            continue
        if rule.kind == "no_effect":
            logger.warning("%s=%s has no effect here: %s", key, text, rule.why)
        for canonical, new in (rule.sets(value) if rule.sets else {}).items():
            if canonical in given and given[canonical] != new:
                problems.append(
                    (
                        key,
                        f"{key}={text} sets {canonical}={render(new)} here, but {canonical}="
                        f"{render(given[canonical])} is given too. Fix: {rule.fix}",
                    )
                )
            elif canonical not in given:
                kept.append(f"++{canonical}={render(new)}")
    if problems:
        raise OverrideError(problems)
    return kept
