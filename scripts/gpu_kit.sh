#!/usr/bin/env bash
# The GPU kit (docs/gpu_and_memory.md, "Running the product on a GPU machine"): carry the packages a bare CUDA image
# lacks to an air-gapped GPU machine in parts of at most 60 MiB, install them there outside the tree, run the checks.
#
#   bash scripts/gpu_kit.sh pack [--python 3.12] [--platform manylinux_2_28_x86_64] [--part-mib 60] [--xz 6]
#                                [--have requirements/cuda-image-packages.txt]
#       where PyPI is reachable, in the project's venv (scripts/setup_env.sh): pip puts the wheels of the packages
#       the image lacks (omni_async.tools.gpu_kit's closure, at requirements/constraints-cpu.txt's versions) for
#       that interpreter and platform into a staging folder, what the product never imports is removed, the rest is
#       tar + xz compressed and split into .gpu_kit/py<python>/kit.tar.xz.NNN with manifest.json (sizes, sha256,
#       versions). --have FILE (the target's `pip list --format=freeze`) carries only what the target lacks.
#   bash scripts/gpu_kit.sh verify        on the GPU machine: which parts are missing or damaged.
#   bash scripts/gpu_kit.sh index-install on a GPU machine that reaches a package index: the same packages from it
#       (pack's .gpu_kit/requirements-X.Y.txt) into the prefix; run then needs no parts.
#   bash scripts/gpu_kit.sh run [check...]
#       on the GPU machine (needs only python3 with torch, transformers and accelerate, the tree and the parts):
#       verifies and joins the parts into $GPU_KIT_PREFIX (default /tmp/omni_async_kit; kept when it already holds
#       this kit), then runs the checks (default: tier main recipe) and writes $GPU_KIT_OUT/gpu_kit_run.json and
#       gpu_kit_run.log (GPU_KIT_OUT default .gpu_kit/out). Checks:
#         tier    the GPU tier of tests: pytest -m gpu tests/gpu
#         main    the main job (tiny:qwen_image_text_bimodal, 20 steps) on one device, OCR on CPU workers
#         recipe  the main job's GPU recipe on random:qwen_image (512², 10 steps, CFG 4, LoRA r64) for 3 steps of
#                 2 prompts x 4 samples
#         import  import the product's dependencies and start Ray with one actor (seconds; for a quick look)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
kit_root="$root/.gpu_kit"

pack() {
  local python=3.12 platform=manylinux_2_28_x86_64 part_mib=60 preset=6 have=()
  while (($#)); do
    case "$1" in
      --python) python="$2"; shift 2 ;;
      --platform) platform="$2"; shift 2 ;;
      --part-mib) part_mib="$2"; shift 2 ;;
      --xz) preset="$2"; shift 2 ;;  # 0-9: 1 packs several times faster on a busy box, a few parts more
      # the target's `python3 -m pip list --format=freeze`: carry only what it lacks (one part instead of four)
      --have) have=(--have "$(realpath "$2")"); shift 2 ;;
      *) echo "gpu_kit pack: unknown option $1 (--python X.Y, --platform TAG, --part-mib N, --xz 0-9, --have FILE)" >&2
         exit 2 ;;
    esac
  done
  local py="$root/.venv/bin/python"
  [[ -x "$py" ]] || { echo "gpu_kit pack: no $py: run bash scripts/setup_env.sh first" >&2; exit 2; }
  local out="$kit_root/py$python" req="$kit_root/requirements-$python.txt" build="$kit_root/build-$python"
  local stage="$build/stage"
  rm -rf "$build"
  mkdir -p "$build"
  "$py" -m omni_async.tools.gpu_kit packages --lock requirements/constraints-cpu.txt --python "$python" "${have[@]}" > "$req"
  echo "[gpu_kit] $(wc -l < "$req") packages for CPython $python ($platform) -> $stage" >&2
  # pip accepts only wheels built for exactly the tags given: every manylinux glibc level up to the one asked for.
  local glibc="${platform#manylinux_}" tags=() minor
  glibc="${glibc%_x86_64}"
  for ((minor = 5; minor <= ${glibc#2_}; minor++)); do tags+=(--platform "manylinux_2_${minor}_x86_64"); done
  tags+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
  rm -rf "$out"
  # Wheels wherever one exists for the target; a package published only as a source archive (antlr4-python3-runtime
  # 4.9.3, which omegaconf pins) is built here, so it must be pure Python: a compiled module built for this
  # interpreter instead of the target's is refused below.
  "$py" -m pip install --quiet --disable-pip-version-check --target "$stage" --no-deps --no-compile \
    --prefer-binary --implementation cp --python-version "$python" "${tags[@]}" -r "$req" \
    2> >(grep -v "is ignored: it is neither" >&2)
  local here wrong
  here="$("$py" -c 'import sys; print("cpython-%d%d" % sys.version_info[:2])')"
  if [[ "$here" != "cpython-${python/./}" ]] && wrong="$(find "$stage" -name "*.${here}-*.so" | head -3)" && [[ -n "$wrong" ]]; then
    echo "gpu_kit pack: built for this interpreter, not CPython $python: $wrong; pack where python$python runs" >&2
    exit 1
  fi
  local before after
  before="$(du -sb "$stage" | cut -f1)"
  "$py" -m omni_async.tools.gpu_kit trim "$stage" > "$build/trimmed.txt"
  after="$(du -sb "$stage" | cut -f1)"
  echo "[gpu_kit] trimmed $(((before - after) >> 20)) MiB; compressing $((after >> 20)) MiB (xz -$preset)" >&2
  local archive="$build/kit.tar.xz"
  # Sorted names and fixed owners: the same packages give the same archive.
  tar -C "$stage" --sort=name --owner=0 --group=0 --numeric-owner -cf - . | xz -T0 "-$preset" > "$archive"
  "$py" - "$req" "$build/trimmed.txt" "$python" "$platform" "$before" "$after" "$preset" "${have[1]:-}" \
    > "$build/info.json" <<'EOF'
import json, sys
from omni_async.tools.gpu_kit import BASE_PACKAGES, DROP, EXTRAS_NOT_FOLLOWED
req, trimmed, python, platform, before, after, preset, have = sys.argv[1:]
pins = dict(line.strip().split("==") for line in open(req) if "==" in line)
print(json.dumps({
    "python": python, "platform": platform, "packages": pins,
    "base": f"what {have} lists" if have else list(BASE_PACKAGES), "dropped": DROP,
    "extras_not_followed": EXTRAS_NOT_FOLLOWED if have else {},
    "trimmed": [line.split(" ", 1)[1].strip() for line in open(trimmed) if line.startswith("trimmed ")],
    "unpacked_bytes": int(after), "trimmed_bytes": int(before) - int(after), "xz_preset": int(preset),
}))
EOF
  "$py" -m omni_async.tools.gpu_kit seal --archive "$archive" --out "$out" --part-mib "$part_mib" --info "$build/info.json"
  rm -rf "$build"
  echo "[gpu_kit] kit: $out ($(du -sh "$out" | cut -f1)); carry it as .gpu_kit/py$python with the tree" >&2
}

target_python() {
  PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
  kit="$kit_root/py$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
}

verify() {
  target_python
  PYTHONPATH="$root" "$PYTHON" -m omni_async.tools.gpu_kit verify "$kit"
}

run() {
  target_python
  local prefix="${GPU_KIT_PREFIX:-/tmp/omni_async_kit}" out="${GPU_KIT_OUT:-$kit_root/out}"
  mkdir -p "$out"
  local log="$out/gpu_kit_run.log" results="$out/gpu_kit_checks.jsonl"
  : > "$log"
  : > "$results"
  local t0=$SECONDS
  if [[ -f "$kit/manifest.json" ]]; then
    PYTHONPATH="$root" "$PYTHON" -m omni_async.tools.gpu_kit install "$kit" "$prefix" 2>&1 | tee -a "$log"
  elif [[ -f "$prefix/.omni_async_kit.json" ]]; then
    echo "[gpu_kit] no parts in $kit: using the packages installed in $prefix (index-install)" | tee -a "$log"
  else
    echo "gpu_kit run: neither $kit/manifest.json (carry the kit's parts) nor an index-install in $prefix" >&2
    exit 2
  fi
  local install_s=$((SECONDS - t0))
  export PYTHONPATH="$prefix:$root${PYTHONPATH:+:$PYTHONPATH}" PYTHON
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  local checks=("$@")
  ((${#checks[@]})) || checks=(tier main recipe)
  local check rc start
  for check in "${checks[@]}"; do
    echo "[gpu_kit] check $check" | tee -a "$log"
    start=$SECONDS
    set +e
    case "$check" in
      import) "$PYTHON" -m omni_async.tools.gpu_kit smoke ;;
      tier) "$PYTHON" -m pytest -q -rs -p no:cacheprovider -m gpu tests/gpu ;;
      main) RUN_DIR="$out/main" NUM_GPUS_REWARD=0 STEPS=20 bash examples/run_qwen_image_ocr_async_reward.sh ;;
      # 2 prompts x 4 samples a step (the recipe's 16 x 8 would take minutes a step): 512², 10 steps, CFG 4, r64
      recipe) RUN_DIR="$out/recipe" NUM_GPUS_REWARD=0 MODEL_PATH=random:qwen_image STEPS=3 BATCH=2 GROUP=4 \
          bash examples/run_qwen_image_ocr_async_reward.sh ;;
      *) echo "unknown check $check (import, tier, main, recipe)"; false ;;
    esac >> "$log" 2>&1
    rc=$?
    set -e
    echo "{\"check\": \"$check\", \"rc\": $rc, \"seconds\": $((SECONDS - start))}" >> "$results"
    echo "[gpu_kit] check $check: rc $rc in $((SECONDS - start)) s" | tee -a "$log"
  done
  "$PYTHON" - "$results" "$out/gpu_kit_run.json" "$prefix" "$install_s" <<'EOF'
import json, platform, sys
results, path, prefix, install_s = sys.argv[1:]
import torch
checks = [json.loads(line) for line in open(results)]
stamp = json.load(open(f"{prefix}/.omni_async_kit.json"))  # the archive's sha256, or "index"
cuda = torch.cuda.is_available()
json.dump({
    "device": torch.cuda.get_device_name(0) if cuda else "no CUDA device",
    "devices": torch.cuda.device_count() if cuda else 0,
    "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
    "kit_sha256": stamp["sha256"], "install_s": int(install_s),
    "checks": checks, "passed": all(c["rc"] == 0 for c in checks),
}, open(path, "w"), indent=1)
print(f"[gpu_kit] {path}: " + ", ".join(f"{c['check']} rc {c['rc']}" for c in checks))
sys.exit(0 if all(c["rc"] == 0 for c in checks) else 1)
EOF
}

index_install() {
  # A GPU machine that reaches a package index needs only the kit's list (.gpu_kit/requirements-X.Y.txt, which pack
  # writes): the same packages at the same versions, from the index, into the same prefix.
  target_python
  local prefix="${GPU_KIT_PREFIX:-/tmp/omni_async_kit}" req="$kit_root/requirements-${kit##*/py}.txt"
  [[ -f "$req" ]] || { echo "gpu_kit index-install: no $req: carry it from where pack ran" >&2; exit 2; }
  rm -rf "$prefix"
  "$PYTHON" -m pip install --quiet --no-deps --target "$prefix" -r "$req"
  echo "{\"sha256\": \"index\", \"requirements\": \"$req\"}" > "$prefix/.omni_async_kit.json"
  echo "[gpu_kit] installed $(wc -l < "$req") packages into $prefix; now: bash scripts/gpu_kit.sh run" >&2
}

cmd="${1:-}"
shift || true
case "$cmd" in
  pack) pack "$@" ;;
  verify) verify ;;
  index-install) index_install ;;
  run) run "$@" ;;
  *) echo "usage: bash scripts/gpu_kit.sh pack [--python X.Y] | verify | index-install | run [import|tier|main|recipe ...]" >&2
     exit 2 ;;
esac
