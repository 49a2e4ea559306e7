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
want="$(cat pyproject.toml "$lock" | sha256sum | cut -d' ' -f1)"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

echo "[setup] installing omni-async into $venv (first run takes a few minutes)" >&2
python3 -m venv "$venv"
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
