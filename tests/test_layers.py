"""The layers of localspec, as folders, and the one direction of their imports.

base (errors, settings, file rules) < kernels (fast paths with torch references) < runtime (the
target's pass: cache, attention, decoder, graphs, weight formats, timing) < core (the speculative
engine: policy, proposers, acceptance rule, statistics) < store (models, files and measurements on
this machine, and the session that opens an engine from them) < apps (CLI, server, chat UI, bench,
wizard, training). A module may import its own layer and the ones below it, never one above, not
even inside a function or for type checking; and the modules imported when a module is imported
form no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import localspec

LAYERS = ("base", "kernels", "runtime", "core", "store", "apps")
PACKAGE = Path(localspec.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path) -> list[tuple[str, bool]]:
    """(imported localspec module, whether the import runs when the module is imported)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if target == "localspec" or target.startswith("localspec."):
                found.append((target, id(node) in top_level))
    return found


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_module_sits_in_a_layer():
    loose = [m for m in _modules() if _layer(m) is None and m not in ("localspec", "localspec.__main__")]
    assert not loose, f"modules outside the layer folders: {loose}"


def test_no_layer_imports_a_higher_one():
    upward = []
    for name, path in _modules().items():
        own = _layer(name)
        if own is None:
            continue
        for target, _ in _imports(name, path):
            theirs = _layer(target)
            if theirs is not None and theirs > own:
                upward.append(f"{name} ({LAYERS[own]}) imports {target} ({LAYERS[theirs]})")
    assert not upward, "\n".join(upward)


def test_module_imports_form_no_cycle():
    modules = _modules()
    graph = {name: {t for t, top in _imports(name, path) if top and t in modules and t != name}
             for name, path in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_the_check_sees_an_upward_import(tmp_path):
    """The walk itself: a runtime module importing the engine is caught, inside a function too."""
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from localspec.core.engine import Engine\n")
    assert _imports("localspec.runtime.probe", path) == [("localspec.core.engine", False), ("localspec.core.engine.Engine", False)]
    assert _layer("localspec.core.engine") > _layer("localspec.runtime.probe")
