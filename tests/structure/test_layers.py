"""Import structure, read from the source with ``ast``: no import cycle among ``omni_async`` modules (lazy and ``TYPE_CHECKING`` ones included), imports only
point down the layers, ``omni_async`` never imports ``http_scorer``, and every YAML key is read by code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "omni_async"

# Lower layers never import higher ones (not even lazily inside a function).
LAYERS = {
    "sample": 0,
    "logs": 0,  # omni_async.logs: every layer logs through it
    "batching": 0,
    "config_error": 0,  # omni_async.config_error: every layer's config checks raise it
    "algos": 1,
    "models": 2,
    "cluster": 3,
    "config": 3,  # omni_async.config: the YAML, its schema, upstream spellings and model paths (reads models only)
    "modality": 3,
    "reward": 4,
    "agent_loop": 5,
    "trainer": 6,
    "tools": 7,
}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, module_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def graph(root: Path, prefix: str, module_level_only: bool) -> dict[str, set[str]]:
    files = {module_name(p): p for p in root.rglob("*.py")}
    return {
        m: {d for d in imports(p, module_level_only) if d in files and d != m}
        for m, p in files.items()
        if m.startswith(prefix)
    }


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (c := visit(d)):
                return c
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(g):
        if m not in state and (c := visit(m)):
            return c
    return None


def layer(module: str) -> int:
    return LAYERS[module.split(".")[1]]


def test_no_import_cycle_even_lazy_or_type_checking_ones():
    # Every import counts: module level, inside functions and under TYPE_CHECKING (ast.walk sees them all). The
    # batcher sits beside the rollout Protocol (agent_loop/batcher.py), the seeds with the draws (draws.py), the
    # override rules with the upstream keys and Hydra's override parse with the schema, so nothing imports back.
    assert find_cycle(graph(ROOT, "omni_async", module_level_only=False)) is None


def test_imports_point_down_the_layers_even_lazy_ones():
    bad = [
        (m, d)
        for m, deps in graph(ROOT, "omni_async.", module_level_only=False).items()
        for d in deps
        if d.startswith("omni_async.") and len(d.split(".")) > 1 and layer(d) > layer(m)
    ]
    assert not bad, bad


def test_cycle_finder_finds_a_cycle():  # the check above would be worthless if this failed
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_http_scorer_depends_on_omni_async_never_the_reverse():
    pkg_deps = {d for p in PKG.rglob("*.py") for d in imports(p, module_level_only=False)}
    assert not {d for d in pkg_deps if d.split(".")[0] == "http_scorer"}
    server_deps = {d for p in (ROOT / "http_scorer").rglob("*.py") for d in imports(p, module_level_only=False)}
    assert not {d for d in server_deps if d.startswith("omni_async.trainer")}


def _yaml_keys(node, prefix=""):
    for k, v in node.items():
        if k == "defaults":
            continue
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from _yaml_keys(v, key + ".")
        else:
            yield key


def test_every_yaml_key_is_read_by_code():
    """A key's last component must appear as an attribute/item read somewhere in the package (or the example
    scripts that pass it through), so no key is accepted and ignored."""
    source = "\n".join(p.read_text() for p in PKG.rglob("*.py"))
    unread = []
    for cfg in (PKG / "config").glob("*.yaml"):
        for key in _yaml_keys(yaml.safe_load(cfg.read_text())):
            leaf = key.split(".")[-1]
            # Read as cfg.x.leaf, cfg["leaf"], r.leaf, spec.get("leaf"), for k in ("leaf", ...), or dict(**section).
            pattern = rf"\.{leaf}\b|\[[\"']{leaf}[\"']\]|[\"']{leaf}[\"']"
            if not re.search(pattern, source):
                unread.append(f"{cfg.name}: {key}")
    assert not unread, unread
