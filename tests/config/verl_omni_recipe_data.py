"""verl-omni's diffusion recipes as test data, the stand-ins that swap their models, engines and reward files for
tiny ones here (``STAND_INS``), what a one-step CPU run changes besides (``ON_CPU``), the keys that pick no code path
in such a run (``CODE_PATH_NEUTRAL``), and what composing, starting or grouping recipes here gives (used by
``test_verl_omni_recipes.py``, ``test_verl_omni_recipe_runs.py`` and ``scripts/verl_omni_recipes_table.py``, which
writes ``docs/verl_omni_recipes.md``).

The recipes' overrides are in ``verl_omni_recipes/<trainer>.<model>.<script>.txt``, written by
``scripts/extract_verl_omni_recipes.py`` from verl-omni at the commit each file's first line names.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser

from omni_async.config.overrides import OverrideError
from omni_async.config_error import ConfigError
from omni_async.trainer.config import compose, validate

RECIPE_DIR = Path(__file__).resolve().parent / "verl_omni_recipes"
OFFLINE_DPO_DATA = Path(__file__).resolve().parents[2] / "examples/data/offline_dpo"

# Keys whose meaning is not built yet: the tests leave them out until it is; with the set empty the tests expect them
# to compose (MixGRPO's rollout.algo.sample_strategy was here until its schedule was wired into the draws).
OWNED_ELSEWHERE: frozenset[str] = frozenset()

# What a recipe's run on this CPU box swaps, key -> {verl-omni's value: (the value here, why)}; None matches any
# value. Only models, engines, reward models, reward functions' files and the reward server: every other value is the
# recipe's (a run also changes the sizes and its own files: ON_CPU).
VERL_OMNI_REWARDS = Path(__file__).resolve().parents[1] / "reward/verl_omni_rewards/verl_omni/utils/reward_score"
EDIT_DATA = Path(__file__).resolve().parents[2] / "examples/data/qwen_image_edit"
_JUDGE = str(Path(__file__).resolve().parent / "verl_omni_judge_stand_in.py")
_GENRM = (
    _JUDGE,
    "this project's GenRM-OCR judge (omni_async.reward.scorers.vlm_judge) with the recipe's reward model, plus a "
    "1e-3 x JPEG-kB tie-break: a random tiny judge reads every random tiny image alike, and equal rewards train nothing",
)
SCORER_URL = "http://127.0.0.1:19082"  # stand_in's default for {scorer_url}; a run passes its own server's URL
STAND_INS: dict[str, dict[str | None, tuple[str, str]]] = {
    "actor_rollout_ref.model.path": {
        "Qwen/Qwen-Image": ("tiny:qwen_image", "a random Qwen-Image of the same architecture, built offline"),
        "/home/user/huggingface/Qwen-Image": ("tiny:qwen_image", "the same"),
        "stabilityai/stable-diffusion-3.5-medium": ("tiny:sd3", "a random SD3 of the same architecture"),
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers": (
            "tiny:wan22",
            "a random Wan 2.2 WanPipeline (A14B's two-expert layout: there is no tiny build of TI2V-5B's one-expert, "
            "48-channel-VAE layout here); the DanceGRPO recipe is refused before a model loads",
        ),
        "Qwen/Qwen-Image-Edit-2511": (
            "tiny:qwen_image_edit",
            "a random Qwen-Image-Edit-2511 (QwenImageEditPlusPipeline, zero_cond_t) built offline; its input images "
            "go through the VAE at 64x64, not 1024x1024 (a stand-in's size)",
        ),
    },
    "actor_rollout_ref.rollout.name": {"vllm_omni": ("transformers", "rollout here runs diffusers")},
    "actor_rollout_ref.model.attn_backend": {
        "_flash_3_varlen_hub": ("native", "FA3 is a CUDA kernel (package kernels): this CPU box runs torch SDPA")
    },
    "actor_rollout_ref.rollout.rollout_attn_backend": {
        "FLASH_ATTN_3_HUB": ("TORCH_SDPA", "verl-omni's pair of native, swapped with it")
    },
    "distillation.teacher_models.teacher_model.model_path": {
        None: ("tiny:sd3_teacher", "tiny:sd3 with its transformer drawn from another seed (a teacher of its family)")
    },
    "reward.reward_model.model_path": {None: ("tiny:qwen2_vl", "a random Qwen2-VL judge, built offline")},
    "reward.reward_model.rollout.name": {"vllm": ("transformers", "no vLLM on this box: the judge runs in-worker")},
    "reward.custom_reward_function.path": {
        "verl_omni/utils/reward_score/genrm_ocr.py": _GENRM,
        "verl_omni/utils/reward_score/hpsv3_reward.py": (
            str(Path(__file__).resolve().parent / "verl_omni_hpsv3_stand_in.py"),
            "no HPSv3 model here: each scored frame's contrast under verl-omni's function name, signature, frame "
            "sampling of the [C, F, H, W] video and return",
        ),
        "pkg://verl_omni.utils.reward_score.pickscore_reward": (
            str(Path(__file__).resolve().parent / "verl_omni_pickscore_stand_in.py"),
            "no PickScore model here: closeness of the edited image to its input image (extra_info's "
            "condition_images), under verl-omni's function name",
        ),
    },
    "data.train_files": {
        "/verl-omni/data/qwen_image_edit/train.parquet": (
            str(EDIT_DATA / "train.parquet"),
            "the tiny edit set in verl-omni's columns (examples/data/prepare_qwen_image_edit.py), kept by ON_CPU",
        )
    },
    "data.val_files": {
        "/verl-omni/data/qwen_image_edit/test.parquet": (str(EDIT_DATA / "test.parquet"), "the same, kept by ON_CPU")
    },
    "+reward.reward_functions.ocr.path": {
        "/verl-omni/verl_omni/utils/reward_score/genrm_ocr.py": _GENRM,
        "pkg://verl_omni.utils.reward_score.http_scorer_client": (
            "pkg://omni_async.reward.scorers.http",
            "this project's HTTP scorer client (verl-omni's http_scorer_client)",
        ),
    },
    "+reward.reward_functions.ocr.server_url": {
        "http://localhost:19082": (
            "{scorer_url}",
            "this project's scorer server (python -m http_scorer serve --scorer jpeg) on loopback, started by the "
            "run: PP-OCR reads no text in a random tiny model's images, every score would be 0 and train nothing",
        )
    },
    "+reward.reward_functions.drm.path": {
        "pkg://verl_omni.utils.reward_score.latent_http_scorer_client": (
            str(Path(__file__).resolve().parent / "verl_omni_drm_stand_in.py"),
            "no DRM server here: the latent's score computed in-process under verl-omni's client's signature, reading "
            "the clean latent and extra_info's prompt encodings as it does (the recipe's server_url is not called)",
        )
    },
    "+reward.reward_functions.jpeg.path": {
        "/verl-omni/verl_omni/utils/reward_score/jpeg_compressibility.py": (
            str(VERL_OMNI_REWARDS / "jpeg_compressibility.py"),
            "verl-omni's own file, unchanged, where this checkout keeps it (tests/reward/verl_omni_rewards)",
        )
    },
}

# What a recipe's one-step training run on this CPU box changes besides STAND_INS, key -> (value, why): sizes that
# fit two CPU cores, and the run's own files. Set where the recipe sets the key, added where it does not;
# ``{data}`` and ``{run}`` are the run's temporary directories. Every other value is the recipe's.
ON_CPU: dict[str, tuple[str, str]] = {
    "data.train_files": (
        "{data}/train.jsonl",
        "4 local OCR prompts (the recipe's parquet files are on its machines; a data file STAND_INS swaps is kept)",
    ),
    "data.val_files": ("{data}/val.jsonl", "2 local OCR prompts (validation does not run in one step)"),
    "data.train_batch_size": ("2", "2 prompts per step"),
    "actor_rollout_ref.rollout.n": ("2", "groups of 2 samples"),
    "actor_rollout_ref.actor.ppo_mini_batch_size": ("2", "one mini-batch of the step's 2 groups: one update"),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": ("2", "a mini-batch (2 samples) in one micro-batch"),
    "actor_rollout_ref.rollout.pipeline.height": ("32", "32x32 images: 2x2 image tokens in the transformer"),
    "actor_rollout_ref.rollout.pipeline.width": ("32", "the same"),
    "actor_rollout_ref.rollout.agent.num_workers": ("1", "one rollout worker"),
    "actor_rollout_ref.rollout.n_gpus_per_node": ("1", "a one-device rollout pool (separate_async)"),
    "trainer.n_gpus_per_node": ("1", "one (logical) trainer device"),
    "trainer.nnodes": ("1", "one node (the multi-node recipe's 2: a Ray cluster of one machine here)"),
    "reward.num_workers": ("1", "one reward worker"),
    "trainer.total_training_steps": ("1", "one step"),
    "trainer.val_before_train": ("False", "no validation (DiffusionOPD's recipe validates first): the step trains"),
    "trainer.logger": ("[console]", "wandb needs an account and the network; metrics.jsonl is written anyway"),
    "trainer.log_image_freq": ("-1", "no sample pictures"),
    "trainer.log_timeline_freq": ("-1", "no timeline pictures"),
    "trainer.run_dir": ("{run}", "the run's temporary directory"),
    "trainer.default_local_dir": ("{run}/checkpoints", "checkpoints in the run's directory, not the recipe's"),
    "trainer.rollout_data_dir": ("{run}/samples", "the same"),
    "trainer.validation_data_dir": ("{run}/validation", "the same"),
}

# Sizes a one-step CPU run lowers to at most this where the recipe sets more, key -> (cap, why); unset or smaller
# values are the recipe's.
ON_CPU_CAPS: dict[str, tuple[int, str]] = {
    "actor_rollout_ref.rollout.pipeline.max_sequence_length": (
        256,
        "Wan's UMT5 pads every prompt to this length: at the DanceGRPO recipe's 1024 a tiny Wan 2.2 generates ~5x "
        "slower on CPU; the test prompts are a few tokens (the edit recipe's 8192 too: Qwen's encoder does not pad)",
    ),
}

# Keys whose value does not pick a code path of a one-step CPU run, key -> why. Recipes whose configs (stand-ins and
# ON_CPU applied) differ only in these keys train the same code, and one run covers them (``runs``).
CODE_PATH_NEUTRAL: dict[str, str] = {
    "trainer.project_name": "a label of the run's logs",
    "trainer.experiment_name": "the same",
    "trainer.save_freq": "a one-step run saves once, at its end, whatever the frequency",
    "trainer.test_freq": "validation every N > 1 steps: none in one step (the run test asserts N != 1)",
    "trainer.total_epochs": "total_training_steps is set",
    "trainer.resume_mode": "auto or disable: a fresh run directory holds nothing to resume",
    "trainer.log_val_generations": "validation only",
    "data.val_max_samples": "validation only",
    "data.max_prompt_length": "a bound the 4 short prompts are within",
    "data.seed": "a seed of the prompt order, the same code",
    "actor_rollout_ref.rollout.seed": "a seed of the samples' noise, the same code",
    "actor_rollout_ref.actor.optim.lr": "a number in the same AdamW step",
    "actor_rollout_ref.actor.optim.weight_decay": "the same",
    "actor_rollout_ref.actor.diffusion_loss.clip_ratio": "a number in the same clipped loss",
    "actor_rollout_ref.model.lora_rank": "the adapters' size, the same LoRA code (0, a full fine-tune, is another code "
    "path: ``effective`` keeps whether the rank is > 0)",
    "actor_rollout_ref.model.lora_alpha": "a number in the same LoRA code (none in a full fine-tune)",
    "actor_rollout_ref.model.target_modules": "which linear layers carry an adapter, the same LoRA code",
    "actor_rollout_ref.rollout.algo.noise_level": "a number in the same SDE step",
    "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps": "validation only",
    "reward.reward_model.rollout.gpu_memory_utilization": "a vLLM judge setting; the judge here runs transformers",
    "reward.reward_model.rollout.max_model_len": "the same",
    "reward.reward_model.rollout.max_num_seqs": "the same",
    "reward.reward_model.rollout.tensor_model_parallel_size": "the same (1 on a one-device reward pool)",
    "trainer.use_v1": "verl v1's spelling of the mode; validate folds trainer.v1.* into the keys compared here",
    "trainer.v1.trainer_mode": "the same",
}

# Keys that change how a run is watched, not what it trains: Nsight Systems profiling (the profiled actor ranks start
# under nsys, open a capture range around the profiled steps and mark their phases with NVTX ranges; the same update,
# rollout and reward code runs). Left out of ``effective`` as CODE_PATH_NEUTRAL's keys are, but a group with a recipe
# that profiles is run as that recipe (``runs``), so the profiling path is run too.
PROFILING = ("global_profiler.", "actor_rollout_ref.actor.profiler.")


def profiles(overrides: list[str]) -> bool:
    """``overrides`` turn Nsight Systems profiling on (``global_profiler.tool`` set)."""
    return any(key_of(o).lstrip("+") == "global_profiler.tool" and not o.endswith("=null") for o in overrides)


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


def stand_in(overrides: list[str], scorer_url: str = SCORER_URL) -> list[str]:
    """``overrides`` with the models, engines, reward models and reward files swapped (``STAND_INS``); a reward
    server's URL becomes ``scorer_url``."""
    out = []
    for line in overrides:
        lhs, _, value = line.partition("=")
        swaps = STAND_INS.get(lhs, {})
        swap = swaps.get(value) or swaps.get(None)
        out.append(f"{lhs}={swap[0].format(scorer_url=scorer_url)}" if swap else line)
    return out


# An offline recipe's data (``algorithm.sample_source=offline``: Diffusion-DPO on a dataset's preference pairs, not on
# prompts) instead of ON_CPU's prompt rows, key -> (value, why).
ON_CPU_OFFLINE: dict[str, tuple[str, str]] = {
    "data.train_files": (
        str(OFFLINE_DPO_DATA / "train.parquet"),
        "4 preference pairs for tiny:sd3 at 32x32 in verl-omni's OfflineDPODataset columns (examples/data/offline_dpo)",
    ),
    "data.val_files": (str(OFFLINE_DPO_DATA / "test.parquet"), "2 more (offline DPO does not validate)"),
}


# A sequence-parallel recipe's run (``ulysses_sequence_parallel_size`` = sp > 1) instead of ON_CPU's one actor rank,
# key -> (value, why); ``{sp}`` is the recipe's size.
ON_CPU_SEQUENCE_PARALLEL: dict[str, tuple[str, str]] = {
    "trainer.n_gpus_per_node": (
        "{sp}",
        "one sequence-parallel group of the recipe's sp actor ranks (one data-parallel rank)",
    ),
    "actor_rollout_ref.rollout.agent.num_workers": ("{sp}", "the hybrid layout's rollout worker per actor rank"),
}
SEQUENCE_PARALLEL_KEY = "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"


def on_cpu(overrides: list[str], data: str | Path, run: str | Path) -> list[str]:
    """A recipe's overrides (its stand-ins already swapped) as one training step on this CPU box runs them:
    ``ON_CPU``'s values (an offline recipe's data: ``ON_CPU_OFFLINE``'s) where the recipe sets those keys, and added
    where it does not; ``ON_CPU_CAPS``' sizes where the recipe sets larger ones."""
    offline = ON_CPU_OFFLINE if "algorithm.sample_source=offline" in overrides else {}
    sp = next((int(o.partition("=")[2]) for o in overrides if o.startswith(f"{SEQUENCE_PARALLEL_KEY}=")), 1)
    group = {k: (v.format(sp=sp), why) for k, (v, why) in ON_CPU_SEQUENCE_PARALLEL.items()} if sp > 1 else {}
    values = {k: v.format(data=data, run=run) for k, (v, _) in {**ON_CPU, **offline, **group}.items()}
    out, seen = [], set()
    for line in overrides:
        lhs, _, value = line.partition("=")
        key = lhs.lstrip("+")
        if key in values and value in {v for v, _ in STAND_INS.get(key, {}).values()}:  # a stand-in data file
            out.append(line)
            seen.add(key)
        elif key in values:
            out.append(f"{lhs}={values[key]}")
            seen.add(key)
        elif key in ON_CPU_CAPS and value.isdigit() and int(value) > ON_CPU_CAPS[key][0]:
            out.append(f"{lhs}={ON_CPU_CAPS[key][0]}")
        else:
            out.append(line)
    return out + [f"{k}={v}" for k, v in values.items() if k not in seen]


def start_refusal(overrides: list[str]) -> list[tuple[str, str]]:
    """What refuses ``overrides`` at start, before Ray: the override check and compose (``main.py``), then
    ``trainer.config.check_at_start`` (the first thing ``RLTrainer`` does). One ``(key, message)`` per problem named;
    empty when the run starts."""
    from omni_async.config_error import ConfigErrors
    from omni_async.trainer.config import check_at_start

    try:
        check_at_start(compose(overrides))
    except (OverrideError, ConfigErrors) as err:
        return list(err.problems)
    except ConfigError as err:
        return [(re.match(r"[\w./]+", str(err)).group(0), str(err))]
    return []


# The one refusal a recipe may meet at its real world size and still train its step at ON_CPU's (one rank, 2 prompts
# per mini-batch): a mini-batch of fewer prompt groups than data-parallel ranks (the 64-card recipes' 16 for 64 ranks;
# verl-omni's own update stops there too, ``test_64_card_recipes_refusal_is_verl_omnis_own_arithmetic``). The run
# shrinks the world and the mini-batch together, as for every other recipe; the product's check is not loosened.
WORLD_SIZE_REFUSAL = "actor_rollout_ref.actor.ppo_mini_batch_size"
# Each refusal at real sizes only -> what the recipe table says of it.
SIZE_REFUSALS = {
    WORLD_SIZE_REFUSAL: "fewer prompt groups per mini-batch than data-parallel ranks; verl-omni's own update stops "
    "there too, on its micro-batches",
}


def refused_only_at_real_world_size(overrides: list[str]) -> bool:
    """``overrides`` (stand-ins swapped) are refused at start only on ``SIZE_REFUSALS``' keys, and start at ON_CPU's
    world and sizes."""
    keys = {k for k, _ in start_refusal(overrides)}
    return bool(keys) and keys <= set(SIZE_REFUSALS) and not start_refusal(on_cpu(overrides, "/data", "/run"))


def trainable() -> list[str]:
    """The recipes that start here with their stand-ins, or that do at ON_CPU's world size and are refused at their
    real one only for it (``refused_only_at_real_world_size``); the others are refused at start (``start_refusal``)."""
    out = []
    for name, overrides in recipes().items():
        swapped = stand_in(overrides)
        if not start_refusal(swapped) or refused_only_at_real_world_size(swapped):
            out.append(name)
    return out


def effective(overrides: list[str]) -> dict:
    """The validated config of ``overrides`` (a recipe with its stand-ins and ON_CPU), flat, ``CODE_PATH_NEUTRAL``
    keys left out: two recipes with equal ones run the same code in a one-step CPU run."""
    from omegaconf import OmegaConf

    flat: dict = {}

    def walk(node, prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict) and v:
                walk(v, f"{prefix}{k}.")
            elif f"{prefix}{k}" not in CODE_PATH_NEUTRAL and not f"{prefix}{k}".startswith(PROFILING):
                flat[f"{prefix}{k}"] = v

    cfg = validate(compose(overrides))
    walk(OmegaConf.to_container(cfg, resolve=True), "")
    flat["(lora)"] = cfg.actor_rollout_ref.model.lora_rank > 0  # LoRA or a full fine-tune: two code paths
    return flat


def runs(names: list[str]) -> dict[str, list[str]]:
    """``names`` grouped by their effective config (``effective``): the first of each group -> the group, its first
    recipe the one that profiles if one does (``PROFILING``). One training run of the first covers the group."""
    every = recipes()
    configs = {name: effective(on_cpu(stand_in(every[name]), "/data", "/run")) for name in names}
    groups: dict[str, list[str]] = {}
    for name in names:
        first = next((f for f in groups if configs[f] == configs[name]), None)
        groups.setdefault(first or name, []).append(name)
    out = {}
    for group in groups.values():
        group = sorted(group, key=lambda n: not profiles(every[n]))  # stable: otherwise in the given order
        out[group[0]] = group
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
