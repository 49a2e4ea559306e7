"""The mode and the layout are decided once and handed down (issue 52 item 1), read from the source with ``ast``:
``mode_of``, ``layout_class`` and ``nsys_plan`` (profiling; also the entry point's re-run under nsys) are called only
in ``trainer.config.plan``, no layout name is compared as a string
outside ``trainer/layout.py``, and nothing outside it reads ``hybrid_engine`` (the key that names a layout). The
trainer and the image modality ask the loss's registry entry (``algos.loss_modes.LossMode``), never its name."""

from __future__ import annotations

import ast
from pathlib import Path

from omni_async.algos.loss_modes import LOSS_MODES

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "omni_async"
LAYOUT_NAMES = {"hybrid", "split", "disaggregated"}
CONFIG = "omni_async/trainer/config.py"
ONE_PLACE = (CONFIG, "plan")  # where the Mode and the Layout are built from the config
LAYOUT_MODULE = "omni_async/trainer/layout.py"
# The memory planner's "hybrid" / "rollout" / "trainer" name a device's role in its table (given on its command line),
# not the run's layout: no config is read there.
NOT_THE_RUN_LAYOUT = {"omni_async/tools/memory_layouts.py"}
# Where a loss is trained: they ask the LossMode (its flags), never compare the loss's name or its backward's.
ASKS_THE_LOSS_MODE = ("omni_async/trainer/", "omni_async/modality/image.py")
# the config's validation compares the values it checks (algorithm.adv_estimator=flow_grpo names an estimator)
VALIDATES_NAMES = {CONFIG}
LOSS_NAMES = set(LOSS_MODES) | {m.backward for m in LOSS_MODES.values()}
LOSS_NAME_ATTRS = {"loss_mode", "backward"}  # x.loss_mode == ..., mode.backward == ... (whatever the other side)


def sources() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(ROOT)), ast.parse(p.read_text())) for p in sorted(PKG.rglob("*.py"))]


def calls_outside(tree: ast.Module, path: str, names: set[str], allowed: set[tuple[str, str]]) -> list[str]:
    """``path:line name`` for each call of one of ``names`` that is not inside one of the ``allowed`` functions
    (``(path, function name)``)."""
    found = []

    def visit(node: ast.AST, func: str | None) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            func = node.name
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in names and (path, func) not in allowed:
                found.append(f"{path}:{node.lineno} {name}")
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, None)
    return found


def name_compares(tree: ast.Module, path: str, names: set[str], attrs: frozenset[str] = frozenset()) -> list[str]:
    """``path:line`` of each ``==`` / ``!=`` / ``in`` with one of ``names``' strings on a side (alone or in a
    tuple / list / set), or an attribute named one of ``attrs`` (``getattr(x, "attr", ...)`` included)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        strings, read = set(), set()
        for side in sides:
            if isinstance(side, ast.Constant) and isinstance(side.value, str):
                strings.add(side.value)
            elif isinstance(side, ast.Tuple | ast.List | ast.Set):
                strings |= {e.value for e in side.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            elif isinstance(side, ast.Attribute):
                read.add(side.attr)
            elif isinstance(side, ast.Call) and isinstance(side.func, ast.Name) and side.func.id == "getattr":
                read |= {a.value for a in side.args[1:2] if isinstance(a, ast.Constant)}
        if strings & names or read & attrs:
            found.append(f"{path}:{node.lineno}")
    return found


def layout_name_compares(tree: ast.Module, path: str) -> list[str]:
    """``path:line`` of each ``==`` / ``!=`` / ``in`` whose other side is a layout name's string."""
    return name_compares(tree, path, LAYOUT_NAMES)


def test_mode_and_layout_built_from_the_config_in_one_place():
    bad = [hit for path, tree in sources() for hit in calls_outside(tree, path, {"mode_of"}, {ONE_PLACE})]
    # config.layout: the layout's name for tests and messages, never a decision
    bad += [
        hit
        for path, tree in sources()
        for hit in calls_outside(tree, path, {"layout_class"}, {ONE_PLACE, (CONFIG, "layout")})
    ]
    # the profiling plan: the trainer's (config.plan) and the entry point's, which re-runs itself under nsys
    bad += [
        hit
        for path, tree in sources()
        for hit in calls_outside(
            tree, path, {"nsys_plan"}, {ONE_PLACE, ("omni_async/trainer/profiling.py", "rerun_under_nsys")}
        )
    ]
    # the partial-rollout decision is the Mode's (Mode.interrupts_at_sync), made in mode_of
    bad += [
        hit
        for path, tree in sources()
        for hit in calls_outside(tree, path, {"interrupts_at_sync"}, {("omni_async/trainer/mode.py", "mode_of")})
    ]
    assert not bad, f"build the Mode / Layout / profiling plan only in {CONFIG}::plan and hand it down: {bad}"


def test_no_layout_name_compared_outside_the_layout():
    bad = [
        hit
        for path, tree in sources()
        if path != LAYOUT_MODULE and path not in NOT_THE_RUN_LAYOUT
        for hit in layout_name_compares(tree, path)
    ]
    assert not bad, f"ask the Layout (its class attributes), not its name: {bad}"


def test_only_the_layout_reads_the_key_that_names_it():
    bad = [
        f"{path}:{node.lineno}"
        for path, tree in sources()
        if path != LAYOUT_MODULE
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "hybrid_engine"
    ]
    assert not bad, f"actor_rollout_ref.hybrid_engine is read by trainer.layout.layout_class only: {bad}"


def test_no_loss_name_compared_where_losses_are_trained():
    bad = [
        hit
        for path, tree in sources()
        if path.startswith(ASKS_THE_LOSS_MODE) and path not in VALIDATES_NAMES
        for hit in name_compares(tree, path, LOSS_NAMES, frozenset(LOSS_NAME_ATTRS))
    ]
    assert not bad, f"ask the LossMode (a flag in algos.loss_modes), not the loss's name: {bad}"


def test_the_checks_find_what_they_look_for():  # the checks above would be worthless if these failed
    tree = ast.parse("def f(cfg):\n    return mode_of(cfg)\n\nx = name == 'split'\n")
    assert calls_outside(tree, "m.py", {"mode_of"}, {ONE_PLACE}) == ["m.py:2 mode_of"]
    assert calls_outside(tree, CONFIG, {"mode_of"}, {(CONFIG, "f")}) == []
    assert layout_name_compares(tree, "m.py") == ["m.py:4"]
    assert layout_name_compares(ast.parse("y = lay in ('hybrid', 'x')"), "m.py") == ["m.py:1"]
    loss = "a = m.loss_mode == x\nb = getattr(m, 'loss_mode', None) == y\nc = k in ('awm', 'q')\nd = m.backward != z\n"
    assert name_compares(ast.parse(loss), "m.py", LOSS_NAMES, frozenset(LOSS_NAME_ATTRS)) == [
        f"m.py:{i}" for i in (1, 2, 3, 4)
    ]
    assert (
        name_compares(ast.parse("e = mode.stratified_steps == True"), "m.py", LOSS_NAMES, frozenset(LOSS_NAME_ATTRS))
        == []
    )
