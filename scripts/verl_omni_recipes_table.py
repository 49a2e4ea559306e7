"""Write ``docs/verl_omni_recipes.md``: what each of verl-omni's diffusion recipes gives here, and what each key they
use means here. Everything in it is computed: the recipes' overrides (``tests/config/verl_omni_recipes/``), composed
and validated as ``tests/config/test_verl_omni_recipes.py`` does, and the rules of
``omni_async/config/upstream_keys.py``.

    python scripts/verl_omni_recipes_table.py
"""

from __future__ import annotations

import logging
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests/config")]

from verl_omni_recipe_data import (  # noqa: E402
    OWNED_ELSEWHERE,
    SIZE_REFUSALS,
    key_of,
    on_cpu,
    outcome,
    recipes,
    runs,
    source,
    stand_in,
    start_refusal,
    trainable,
)

from omni_async.config.overrides import known, rule_for, rule_key  # noqa: E402
from omni_async.trainer.config import compose  # noqa: E402

OUT = ROOT / "docs/verl_omni_recipes.md"
KIND = {
    "same": "accepted where it means what this project does, other values refused",
    "renamed": "renamed",
    "no_effect": "accepted, no effect here (logged)",
    "refused": "refused",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _refused(result, owned: bool) -> str:
    if result.error:
        return f"**unexpected error**: {_cell(result.error)}"
    keys = sorted(result.keys() - (OWNED_ELSEWHERE if not owned else set()))
    if not keys:
        return "composes and validates"
    return "refused: " + ", ".join(f"`{k}`" for k in keys)


def _here(name: str, overrides: list[str], covered_by: dict[str, str]) -> str:
    """The last column: the one-step CPU run that trains the recipe, or what refuses it at start (before Ray)."""
    if name in covered_by:
        runner = covered_by[name]
        rank = compose(on_cpu(stand_in(overrides), "/data", "/run")).actor_rollout_ref.model.lora_rank
        what = f"LoRA r{rank}" if rank > 0 else "full fine-tune"
        shrunk = ""
        refused = sorted({k for k, _ in start_refusal(stand_in(overrides))})  # refused_only_at_real_world_size
        if refused:  # the run's world and sizes are ON_CPU's
            why = "; ".join(f"`{k}`: {SIZE_REFUSALS[k]}" for k in refused)
            shrunk = f"refused at its real sizes ({why}); at ON_CPU's sizes "
        return f"{shrunk}trains one step, {what}" + ("" if runner == name else f" (in the run of `{runner}`)")
    keys = sorted({k for k, _ in start_refusal([o for o in stand_in(overrides) if key_of(o) not in OWNED_ELSEWHERE])})
    return "refused at start: " + ", ".join(f"`{k}`" for k in keys)


def recipe_table(all_recipes: dict[str, list[str]]) -> list[str]:
    covered_by = {name: runner for runner, group in runs(trainable()).items() for name in group}
    lines = [
        "| recipe (verl-omni) | overrides | unchanged | with tiny stand-ins"
        + (", keys not built yet left out" if OWNED_ELSEWHERE else "")
        + " | on CPU here (stand-ins, one step) |",
        "|---|---|---|---|---|",
    ]
    for name, overrides in all_recipes.items():
        path = source(name).split(":", 1)[1]
        raw = outcome(overrides)
        owned = sorted(k for k in raw.keys() if k in OWNED_ELSEWHERE)
        unchanged = _refused(raw, owned=False)
        if owned:
            unchanged += f"; keys not built yet: {len(owned)}"
        si = outcome([o for o in stand_in(overrides) if key_of(o) not in OWNED_ELSEWHERE])
        here = _here(name, overrides, covered_by)
        lines.append(f"| `{path}` | {len(overrides)} | {unchanged} | {_refused(si, owned=True)} | {here} |")
    return lines


# Open mappings of nsys command-line options (controller / worker), passed to nsys as given
NSIGHT_OPTIONS = tuple(
    f"global_profiler.global_tool_config.nsys.{side}_nsight_options." for side in ("controller", "worker")
)


def key_table(all_recipes: dict[str, list[str]]) -> tuple[list[str], list[str], list[str]]:
    uses: dict[str, set[str]] = defaultdict(set)
    for name, overrides in all_recipes.items():
        for o in overrides:
            key = key_of(o)
            if key.startswith("reward.reward_functions."):  # one entry per reward function, not per argument
                key = ".".join(key.split(".")[:3]) + ".*"
            elif key.startswith(NSIGHT_OPTIONS):  # nsys' own options (any of them): one entry per mapping
                key = ".".join(key.split(".")[:4]) + ".*"
            elif not known(key, "flowgrpo_trainer") and (rule_key(key) or "").endswith(".*"):
                key = rule_key(key)  # one row per rule covering a whole section (profilers, engine kwargs)
            uses[key].add(name)
    ours = sorted(k for k in uses if known(k.removesuffix(".*"), "flowgrpo_trainer"))
    owned = sorted(k for k in uses if k in OWNED_ELSEWHERE)
    rows = [
        "| key | recipes | here | meaning here / why | what to use instead (values refused) |",
        "|---|---|---|---|---|",
    ]
    for key in sorted(uses):
        if key in ours or key in owned:
            continue
        rule = rule_for(key)
        if rule is None:
            rows.append(f"| `{key}` | {len(uses[key])} | **unknown** | | |")
            continue
        here = KIND[rule.kind] + (f" to `{rule.canonical}`" if rule.kind == "renamed" else "")
        rows.append(f"| `{key}` | {len(uses[key])} | {here} | {_cell(rule.why)} | {_cell(rule.fix)} |")
    return ours, owned, rows


def main() -> None:
    logging.disable(logging.WARNING)  # the no-effect lines of every recipe
    all_recipes = recipes()
    commit = source(next(iter(all_recipes))).split("@", 1)[1].split(":", 1)[0]
    ours, owned, rows = key_table(all_recipes)
    text = [
        "# verl-omni's diffusion recipes here",
        "",
        "<!-- written by scripts/verl_omni_recipes_table.py; do not edit by hand -->",
        "",
        f"verl-omni's {len(all_recipes)} diffusion recipes at `{commit[:7]}` "
        "(`examples/{flowgrpo,grpoguard,flowdppo,mixgrpo,diffusionnft,dancegrpo,diffusionopd,dpo}_trainer/**/*.sh`, "
        "without the NPU copies; "
        f"{sum(map(len, all_recipes.values()))} overrides, extracted by `scripts/extract_verl_omni_recipes.py` with "
        "their shell variables at their defaults into `tests/config/verl_omni_recipes/`; verl-omni's other recipes, "
        "`dpo_trainer/qwen3_omni` and `gspo_trainer/qwen3_omni`, train the Qwen3-Omni LLM / omni-modal thinker, not "
        "a diffusion model, and are left out), composed and validated "
        "here as a whole (`tests/config/test_verl_omni_recipes.py`). A refused key is refused with a `ConfigError` "
        "naming the key, why and what to use instead, never with Hydra's `Could not override`; every key refused "
        "at once is named together. *Unchanged*: the recipe as verl-omni ships it (its model paths, `vllm_omni` "
        "engine and reward files do not exist here, so those are refused too). *With tiny stand-ins*: models, "
        "engines, reward models and reward functions' files swapped as `tests/config/verl_omni_recipe_data.py` "
        "`STAND_INS` documents"
        + ("; keys whose meaning is not built yet (`OWNED_ELSEWHERE`) are left out until it is." if owned else ".")
        + " *On CPU here*: each recipe that starts with its stand-ins trains one step, LoRA of the recipe's rank or, "
        "where it sets no `actor_rollout_ref.model.lora_rank`, a full fine-tune (verl's and verl-omni's default, 0) "
        "(`tests/config/test_verl_omni_recipe_runs.py`, sizes shrunk as `ON_CPU` and `ON_CPU_CAPS` document; "
        "recipes whose configs differ only in keys that pick no code path there, `CODE_PATH_NEUTRAL`, or in "
        "profiling keys, `PROFILING`, share one run, the profiling recipe's when there is one, under a stand-in "
        "`nsys`; a real run needs Nsight Systems' `nsys` on PATH); the others are "
        "refused at start, before Ray, naming the keys listed (the first refusal a user meets: compose-time keys "
        "together, then the validation and the model-path check).",
        "",
        *recipe_table(all_recipes),
        "",
        "## The keys",
        "",
        f"{len(ours)} keys the recipes use are keys of this project's config with verl / verl-omni's meaning "
        "(`omni_async/config/flowgrpo_trainer.yaml`; values this project does not implement are refused naming the "
        "key): " + ", ".join(f"`{k}`" for k in ours) + ".",
        "",
        *(
            [
                f"{len(owned)} keys are not built yet, unknown here until they are: "
                + ", ".join(f"`{k}`" for k in owned)
                + ".",
                "",
            ]
            if owned
            else []
        ),
        "The other keys, by what they mean here (`omni_async/config/upstream_keys.py`; a key ending in `.*` there "
        "covers every key under it):",
        "",
        *rows,
        "",
    ]
    OUT.write_text("\n".join(text))
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
