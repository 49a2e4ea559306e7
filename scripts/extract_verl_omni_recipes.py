"""Write the Hydra overrides of verl-omni's diffusion recipes to ``tests/config/verl_omni_recipes/``.

Each recipe script is run as verl-omni users run it, with its shell variables at their defaults, in a scratch copy
of verl-omni's tree, with stand-ins for the commands that would start work: ``python3``/``python`` record their
arguments instead of training (a ``python3 - <<EOF`` pre-flight exits 0), ``nsys`` runs its command line, ``date``
prints a fixed time so the files do not change from run to run. The trainer command's Hydra overrides (everything
after ``-m <module>``) are written one per line, with the scratch directory replaced by ``/verl-omni`` (and MiniMax-H3's model checkout by
``/models/MiniMax-H3``). Running the
scripts, rather than parsing them, gets what bash gives: defaults, arithmetic, quoting, and the benchmark recipes
that call another recipe with extra overrides. Two more stand-ins for what a recipe reads from its machine:
``nvidia-smi`` exits 0 and ``npu-smi`` exits 1 (DanceGRPO's recipe picks GPU or NPU settings by which of them
runs: it takes its GPU branch, as the other recipes are GPU ones), and the environment variables of ``ENV`` that a recipe
requires and gives no default (DiffusionOPD's ``TEACHER_PATH``).

    python scripts/extract_verl_omni_recipes.py [--repo /work/.mirror/verl-project+verl-omni/repo] [--commit HEAD]

Recipes: ``examples/{flowgrpo,grpoguard,flowdppo,mixgrpo,diffusionnft,dancegrpo,diffusionopd,dpo}_trainer/**/*.sh``,
the NPU copies and the non-diffusion ones (``SKIP``) left out.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "tests/config/verl_omni_recipes"
DEFAULT_REPO = "/work/.mirror/verl-project+verl-omni/repo"
TRAINERS = ("flowgrpo", "grpoguard", "flowdppo", "mixgrpo", "diffusionnft", "dancegrpo", "diffusionopd", "dpo")
# Scripts under those folders that are not diffusion recipes, prefix -> why.
SKIP = {
    "examples/dpo_trainer/qwen3_omni/": "Qwen3-Omni (thinker) DPO: an LLM / omni-modal recipe, not a diffusion one",
}
# Environment a recipe needs that has no default in the script, recipe -> {variable: folders}: MiniMax-H3's recipe
# checks that MODEL_PATH is a local checkout with these folders before it does anything. Only that recipe gets it:
# other recipes read MODEL_PATH too (``${MODEL_PATH:-Qwen/Qwen-Image}``), and must keep their own default.
MODEL_DIRS = {
    "examples/diffusionnft_trainer/minimax_h3/run_minimax_h3_t2va_lora.sh": {"MODEL_PATH": ("FL2VA", "transformer")}
}
# Environment variables a recipe requires and gives no default (``${VAR:?...}`` stops the script without them),
# recipe -> {variable: value}: DiffusionOPD's frozen teacher checkpoint, a placeholder path as the recipe's
# comments describe it (an OCR-tuned SD3.5-Medium with its LoRA merged).
ENV = {
    "examples/diffusionopd_trainer/sd35/run_sd35_medium_ocr_distill.sh": {
        "TEACHER_PATH": "/models/sd35-medium-ocr-teacher"
    },
}

PYTHON_SHIM = """#!/bin/bash
if [ "$1" = "-" ] || [ "$1" = "-c" ]; then cat >/dev/null 2>&1; exit 0; fi
printf '%s\\0' "$@" > "$RECIPE_ARGV"
"""
NSYS_SHIM = """#!/bin/bash
exit 0
"""
NVIDIA_SMI_SHIM = """#!/bin/bash
exit 0
"""
NPU_SMI_SHIM = """#!/bin/bash
exit 1
"""
DATE_SHIM = """#!/bin/bash
echo 20260101_000000
"""


def recipe_paths(repo: str, commit: str) -> list[str]:
    names = subprocess.run(
        ["git", "-C", repo, "ls-tree", "-r", "--name-only", commit, "examples"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    pattern = re.compile(rf"^examples/({'|'.join(TRAINERS)})_trainer/.+\.sh$")
    return sorted(
        n
        for n in names
        if pattern.match(n) and "npu" not in Path(n).name and not any(n.startswith(skip) for skip in SKIP)
    )


def recipe_id(path: str) -> str:
    """``examples/flowgrpo_trainer/sd35/run_sd35_medium_ocr_lora.sh`` -> ``flowgrpo_trainer.sd35.run_sd35_medium_ocr_lora``
    (several trainers ship a script of the same name)."""
    return ".".join(Path(path).with_suffix("").parts[1:])


def overrides_of(argv: list[str]) -> list[str]:
    """The Hydra overrides of a ``python3 -m <module> ...`` command line."""
    if "-m" not in argv:
        raise ValueError(f"not a `python3 -m` trainer command: {argv[:3]}")
    return argv[argv.index("-m") + 2 :]


def run_recipe(tree: Path, path: str, shims: Path) -> list[str]:
    argv_file = tree / ".recipe_argv"
    argv_file.unlink(missing_ok=True)
    env = {
        "PATH": f"{shims}:/usr/bin:/bin",
        "HOME": "/home/user",
        "RECIPE_ARGV": str(argv_file),
        "PROFILE_FINALIZE_TIMEOUT_S": "0",  # the nsys recipe waits this long for reports nobody writes
    }
    for var, folders in MODEL_DIRS.get(path, {}).items():
        model = tree / f".{var.lower()}"
        for folder in folders:
            (model / folder).mkdir(parents=True, exist_ok=True)
        env[var] = str(model)
    env.update(ENV.get(path, {}))
    subprocess.run(
        ["bash", str(tree / path)], cwd=tree, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    if not argv_file.exists():
        raise RuntimeError(f"{path}: the script never started the trainer")
    argv = argv_file.read_text().split("\0")[:-1]
    text = [a.replace(str(tree / ".model_path"), "/models/MiniMax-H3").replace(str(tree), "/verl-omni") for a in argv]
    text = [re.sub(r"(20260101_000000)_\d+", r"\1_PID", a) for a in text]  # the nsys recipe's run id ends in $$
    return overrides_of(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", default=DEFAULT_REPO, help="a verl-omni git directory")
    parser.add_argument("--commit", default="HEAD")
    args = parser.parse_args()
    sha = subprocess.run(
        ["git", "-C", args.repo, "rev-parse", args.commit], check=True, capture_output=True, text=True
    ).stdout.strip()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for old in OUT_DIR.glob("*.txt"):
        old.unlink()
    with tempfile.TemporaryDirectory() as scratch:
        tree, shims = Path(scratch) / "verl-omni", Path(scratch) / "bin"
        tree.mkdir()
        shims.mkdir()
        archive = subprocess.run(["git", "-C", args.repo, "archive", sha], check=True, capture_output=True).stdout
        archive_path = Path(scratch) / "tree.tar"
        archive_path.write_bytes(archive)
        with tarfile.open(archive_path) as tar:
            tar.extractall(tree, filter="data")
        for name, body in (
            ("python3", PYTHON_SHIM),
            ("python", PYTHON_SHIM),
            ("nsys", NSYS_SHIM),
            ("date", DATE_SHIM),
            ("nvidia-smi", NVIDIA_SMI_SHIM),
            ("npu-smi", NPU_SMI_SHIM),
        ):
            (shims / name).write_text(body)
            os.chmod(shims / name, 0o755)
        for path in recipe_paths(args.repo, sha):
            overrides = run_recipe(tree, path, shims)
            header = [
                f"# verl-project/verl-omni@{sha}:{path}",
                "# written by scripts/extract_verl_omni_recipes.py: the recipe's Hydra overrides, its shell variables",
                "# at their defaults, one per line, in its order (data: not code)",
            ]
            (OUT_DIR / f"{recipe_id(path)}.txt").write_text("\n".join(header + overrides) + "\n")
            print(f"{recipe_id(path)}: {len(overrides)} overrides")
        shutil.rmtree(tree, ignore_errors=True)


if __name__ == "__main__":
    main()
