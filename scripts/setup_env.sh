#!/usr/bin/env bash
# Create (or refresh) the project's virtualenv in .venv. Idempotent: a no-op when pyproject.toml and the
# constraints lock are unchanged since the last successful install, so re-running it costs ~0 s.
#
# Order matters: torch is installed first (pip then takes the local CPU build instead of resolving a CUDA
# torch), and everything else is installed against the committed lock so pip never backtracks.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${OMNI_ASYNC_VENV:-$root/.venv}"
lock="$root/requirements/constraints-cpu.txt"
stamp="$venv/.omni_async_installed"

# The interpreter: $OMNI_ASYNC_PYTHON, else the distribution's own CPython when it is the same version as python3 on
# PATH and can make a venv, else python3. Debian and Ubuntu build theirs with PGO and LTO; pyenv's default build
# (--enable-shared, no PGO) runs the test suite, mostly Python, about 7 % slower (docs/testing.md).
pick_python() {
  if [[ -n "${OMNI_ASYNC_PYTHON:-}" ]]; then
    echo "$OMNI_ASYNC_PYTHON"
    return
  fi
  local version system=/usr/bin/python3
  version="$(python3 -c 'import sys; print(sys.version_info[:2])')"
  if [[ -x "$system" ]] && [[ "$("$system" -c 'import sys; print(sys.version_info[:2])' 2>/dev/null)" == "$version" ]] \
      && "$system" -c 'import ensurepip, venv' 2>/dev/null; then
    echo "$system"
  else
    echo python3
  fi
}
python="$(pick_python)"
python_id="$("$python" -c 'import sys; print(sys.executable, sys.version)')"
want="$( (cat pyproject.toml "$lock"; echo "$python_id") | sha256sum | cut -d' ' -f1)"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

echo "[setup] installing omni-async into $venv with $python_id (first run takes a few minutes)" >&2
clear=()
# A venv made by another interpreter is made again (its compiled packages and paths belong to that one).
if [[ -x "$venv/bin/python" ]] && [[ "$("$venv/bin/python" -c 'import os, sys; print(os.path.realpath(sys._base_executable))' 2>/dev/null)" \
    != "$("$python" -c 'import os, sys; print(os.path.realpath(sys.executable))')" ]]; then
  clear=(--clear)
fi
"$python" -m venv ${clear[@]+"${clear[@]}"} "$venv"
# pip warns once per package about this machine's empty local index dirs; that noise hides real errors.
quiet_pip() { "$venv/bin/python" -m pip install --quiet "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
quiet_pip "torch==$(grep -i '^torch==' "$lock" | cut -d= -f3)"
quiet_pip -c "$lock" -e ".[dev]"

# torchvision breaks transformers' image processors on this torch; refuse an environment that has it.
if "$venv/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchvision') is None)"; then
  echo "[setup] torchvision is installed in $venv; remove it: $venv/bin/pip uninstall -y torchvision" >&2
  exit 1
fi
echo "$want" > "$stamp"
echo "[setup] done" >&2
