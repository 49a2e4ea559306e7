"""verl-omni's diffusion recipes as test data, the stand-ins that swap their models, engines and reward files for
tiny ones here, and what composing a recipe here gives (used by ``test_verl_omni_recipes.py`` and by
``scripts/verl_omni_recipes_table.py``, which writes ``docs/verl_omni_recipes.md``).

The recipes' overrides are in ``verl_omni_recipes/<trainer>.<model>.<script>.txt``, written by
``scripts/extract_verl_omni_recipes.py`` from verl-omni at the commit each file's first line names.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser

from omni_async.config_error import ConfigError
from omni_async.trainer.config import compose, validate
from omni_async.trainer.overrides import OverrideError

RECIPE_DIR = Path(__file__).resolve().parent / "verl_omni_recipes"

# Keys whose meaning is not built yet: the tests leave them out until it is; with the set empty the tests expect them
# to compose (MixGRPO's rollout.algo.sample_strategy was here until its schedule was wired into the draws).
OWNED_ELSEWHERE: frozenset[str] = frozenset()

# What a recipe's run on this CPU box swaps, key -> {verl-omni's value: (the value here, why)}; None matches any
# value. Only models, engines, reward models and reward functions' files: every other value is the recipe's.
_GENRM = ("pkg://omni_async.reward.scorers.vlm_judge", "this project's GenRM-OCR judge (verl-omni's genrm_ocr.py)")
STAND_INS: dict[str, dict[str | None, tuple[str, str]]] = {
    "actor_rollout_ref.model.path": {
        "Qwen/Qwen-Image": ("tiny:qwen_image", "a random Qwen-Image of the same architecture, built offline"),
        "/home/user/huggingface/Qwen-Image": ("tiny:qwen_image", "the same"),
        "stabilityai/stable-diffusion-3.5-medium": ("tiny:sd3", "a random SD3 of the same architecture"),
    },
    "actor_rollout_ref.rollout.name": {"vllm_omni": ("transformers", "rollout here runs diffusers")},
    "reward.reward_model.model_path": {None: ("tiny:qwen2_vl", "a random Qwen2-VL judge, built offline")},
    "reward.reward_model.rollout.name": {"vllm": ("transformers", "no vLLM on this box: the judge runs in-worker")},
    "reward.custom_reward_function.path": {"verl_omni/utils/reward_score/genrm_ocr.py": _GENRM},
    "reward.custom_reward_function.name": {"compute_score_ocr": ("compute_score", "the judge's function")},
    "+reward.reward_functions.ocr.path": {
        "/verl-omni/verl_omni/utils/reward_score/genrm_ocr.py": _GENRM,
        "pkg://verl_omni.utils.reward_score.http_scorer_client": (
            "pkg://omni_async.reward.scorers.http",
            "this project's HTTP scorer client (verl-omni's http_scorer_client)",
        ),
    },
    "+reward.reward_functions.ocr.name": {"compute_score_ocr": ("compute_score", "the judge's function")},
    "+reward.reward_functions.jpeg.path": {
        "/verl-omni/verl_omni/utils/reward_score/jpeg_compressibility.py": (
            "pkg://omni_async.reward.scorers.jpeg",
            "this project's JPEG-compressibility reward",
        )
    },
}


def recipes() -> dict[str, list[str]]:
    """recipe id -> its overrides, in its order."""
    return {
        p.stem: [line for line in p.read_text().splitlines() if line and not line.startswith("#")]
        for p in sorted(RECIPE_DIR.glob("*.txt"))
    }


def source(recipe: str) -> str:
    """``verl-project/verl-omni@<commit>:<script path>``."""
    return (RECIPE_DIR / f"{recipe}.txt").read_text().splitlines()[0].lstrip("# ")


@functools.cache
def key_of(override: str) -> str:
    return OverridesParser.create().parse_override(override).key_or_group


def stand_in(overrides: list[str]) -> list[str]:
    """``overrides`` with the models, engines, reward models and reward files swapped (``STAND_INS``)."""
    out = []
    for line in overrides:
        lhs, _, value = line.partition("=")
        swaps = STAND_INS.get(lhs, {})
        swap = swaps.get(value) or swaps.get(None)
        out.append(f"{lhs}={swap[0]}" if swap else line)
    return out


_REWARD_FUNCTIONS = ("reward.custom_reward_function", "reward.reward_functions")


@dataclass
class Outcome:
    """What composing and validating a recipe here gives: every key refused (``(stage, key, message)``; stage
    ``compose`` or ``validate``), found by dropping the refused keys and trying again."""

    refused: list[tuple[str, str, str]] = field(default_factory=list)
    error: str | None = None  # anything but a ConfigError (never expected)

    @property
    def ok(self) -> bool:
        return not self.refused and self.error is None

    def keys(self) -> set[str]:
        return {k for _, k, _ in self.refused}


def outcome(overrides: list[str], config_name: str = "flowgrpo_trainer") -> Outcome:
    result, todo = Outcome(), list(overrides)
    for _ in range(len(overrides) + 1):
        try:
            validate(compose(todo, config_name=config_name))
            return result
        except OverrideError as err:
            bad = {k for k, _ in err.problems}
            result.refused += [("compose", k, m) for k, m in err.problems]
        except ConfigError as err:
            key = re.match(r"[\w./]+", str(err)).group(0)
            if key in result.keys():
                return result  # refused again with the recipe's value dropped: the default is refused too
            if key.startswith(_REWARD_FUNCTIONS) and any(k.startswith(_REWARD_FUNCTIONS) for k in result.keys()):
                return result  # a reward function is refused already; what follows from dropping it is not the recipe's
            result.refused.append(("validate", key, str(err)))
            # a reward function's path goes with the rest of its section (name, weight, kwargs)
            section = key.rsplit(".", 1)[0] if key.endswith(".path") and key.startswith("reward.") else key
            bad = {k for k in map(key_of, todo) if k == section or k.startswith(section + ".")}
            if not bad:
                return result  # a combination named by a key the recipe does not set: nothing to drop
        except Exception as err:  # noqa: BLE001 - recorded: the tests require there is none
            result.error = f"{type(err).__name__}: {err}"
            return result
        todo = [o for o in todo if key_of(o) not in bad]
    return result
