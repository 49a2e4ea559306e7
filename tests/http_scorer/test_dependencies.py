"""Dependency direction: ``http_scorer`` may import ``omni_async`` (scorers, the restricted unpickler), never the
reverse, and the server pulls in nothing from ``omni_async.trainer``."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(package: str) -> dict[str, set[str]]:
    """Every module named by an import statement (absolute, or relative resolved) in each file of a package."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package ("pkg.__init__" counts too)
                    base = module.split(".")[: -node.level]
                    names.add(".".join([*base, node.module] if node.module else base))
                else:
                    names.add(node.module or "")
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__")
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                names.add(str(node.args[0].value))
        out[module] = names
    return out


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_omni_async_never_imports_http_scorer():
    offenders = {
        m: sorted(n for n in names if _under(n, "http_scorer")) for m, names in imported_modules("omni_async").items()
    }
    offenders = {m: n for m, n in offenders.items() if n}
    assert not offenders, offenders
    assert imported_modules("omni_async")  # the scan saw the package's files


def test_http_scorer_imports_nothing_from_the_trainer():
    scanned = imported_modules("http_scorer")
    assert "http_scorer.server" in scanned and any(_under(n, "omni_async") for v in scanned.values() for n in v)
    direct = {m: sorted(n for n in names if _under(n, "omni_async.trainer")) for m, names in scanned.items()}
    assert not any(direct.values()), direct

    # Transitively, too: build the app with each built-in scorer and call it once, then list what got loaded.
    probe = """
import json, sys
import numpy as np
from http_scorer.__main__ import main  # noqa: F401  (the CLI module)
from http_scorer.scorers import BUILTIN
from http_scorer.server import ServerConfig, create_app
for name in BUILTIN:
    create_app(ServerConfig(scorer=name))
BUILTIN["jpeg"]([np.zeros((8, 8, 3), np.uint8)], ["p"], [None], {})
from omni_async.reward.scorers import ocr  # what the ocr scorer imports on its first call
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("omni_async", "http_scorer"))))
"""
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "omni_async.reward.safe_pickle" in loaded and "http_scorer.server" in loaded
    assert not [m for m in loaded if _under(m, "omni_async.trainer")], loaded

    # and importing the project's client side loads no http_scorer module
    probe = (
        "import sys, omni_async.reward.scorers.http, omni_async.reward.scorers.vlm_judge; "
        "print([m for m in sys.modules if m.split('.')[0] == 'http_scorer'])"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr)


def scorer_distribution() -> tuple[set[str], set[str]]:
    """What ``packages/scorer`` (the standalone install) ships: its modules, and the top-level import names of its
    declared dependencies (read from this environment's installed distributions)."""
    from importlib.metadata import packages_distributions

    import tomllib

    cfg = tomllib.loads((ROOT / "packages/scorer/pyproject.toml").read_text())
    setup = cfg["tool"]["setuptools"]
    shipped = set()
    for package in setup["packages"]:
        shipped |= {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / package).glob("*.py")}
        shipped.add(package)
    for module in setup["py-modules"]:
        parts = module.split(".")
        shipped |= {".".join(parts[:k]) for k in range(1, len(parts) + 1)}
    declared = {
        re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower().replace("_", "-") for d in cfg["project"]["dependencies"]
    }
    names = {
        top
        for top, dists in packages_distributions().items()
        if any(d.lower().replace("_", "-") in declared for d in dists)
    }
    return {s.removesuffix(".__init__") for s in shipped}, names


def test_the_standalone_scorer_install_ships_everything_the_server_imports():
    shipped, dependency_names = scorer_distribution()
    assert {"http_scorer.server", "http_scorer.pool", "omni_async.reward.scorers.ocr"} <= shipped
    assert {"fastapi", "uvicorn", "PIL", "numpy", "rapidocr", "onnxruntime", "Levenshtein"} <= dependency_names
    assert not {"torch", "ray", "verl", "diffusers"} & dependency_names
    missing = {}
    for module in sorted(shipped):
        path = ROOT / (module.replace(".", "/") + ".py")
        path = path if path.exists() else ROOT / module.replace(".", "/") / "__init__.py"
        tree = ast.parse(path.read_text())
        # http_scorer runs its lazy imports while serving; the omni_async modules' lazy imports (torch in
        # pixels.to_solution_image, verl's text rewards, paddleocr) are not on the server's path.
        nodes = ast.walk(tree) if module.startswith("http_scorer") else tree.body
        for node in nodes:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                ok = (
                    top in sys.stdlib_module_names
                    or top == "__future__"
                    or top in dependency_names
                    or (top in ("http_scorer", "omni_async") and name in shipped)
                )
                if not ok:
                    missing.setdefault(module, []).append(name)
    assert not missing, f"imports the standalone install (packages/scorer/pyproject.toml) lacks: {missing}"
