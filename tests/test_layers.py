"""The steps of a save import downward only: target <- plan <- write, commit <- saver."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import shardsafe

SRC = Path(shardsafe.__file__).parent
ORDER = ["save_target", "save_plan", "save_write", "commit", "saver"]
# the two last steps both use the plan and the target, never each other
SIDEWAYS = {("save_write", "commit"), ("commit", "save_write")}


def _imports(module: str) -> set[str]:
    tree = ast.parse((SRC / f"{module}.py").read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            out.add((node.module or "").split(".")[0])
            out.update(a.name for a in node.names if node.module is None)
    return out


@pytest.mark.parametrize("module", ORDER)
def test_a_save_step_imports_no_later_step(module: str) -> None:
    later = set(ORDER[ORDER.index(module) + 1 :])
    imported = _imports(module)
    assert not imported & later, f"{module} imports {sorted(imported & later)}"
    assert not {m for m in imported if (module, m) in SIDEWAYS}


# the default Savers of shardsafe.save/async_save, documented and freed by shardsafe.release()
DOCUMENTED_DEFAULTS = {("saver", "_DEFAULT")}


def test_the_save_steps_keep_no_state_at_module_level() -> None:
    """Module-level names are functions, classes, constants and type aliases; no dict, list or
    set that calls would fill."""
    for module in [*ORDER, "dist", "directio", "io_policy", "staging", "engine"]:
        tree = ast.parse((SRC / f"{module}.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = {t.id for t in targets if isinstance(t, ast.Name)}
                if {(module, n) for n in names} & DOCUMENTED_DEFAULTS:
                    continue
                value = node.value
                assert not isinstance(value, ast.Dict | ast.List | ast.Set), (
                    f"{module}.py:{node.lineno} keeps a mutable container at module level"
                )
