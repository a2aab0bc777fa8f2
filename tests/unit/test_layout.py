"""The package's layout rules, read from the source with ``ast``:

- the core (``nwor/``, ``scv/``, ``telemetry/``, ``config.py``) imports nothing of vLLM and
  nothing of ``vllm_nwor.patches`` (nor the façade modules that reach into it);
- no module imports a ``_private`` name from another module;
- the package's imports, as a graph of modules, have no cycle (deferred imports included);
- a feature's patches (``patches/nwor``, ``patches/scv``, ``patches/telemetry``,
  ``patches/synthetic.py``) import no other feature's (what one leaves for another goes through
  ``patches/shared.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
CORE = ("vllm_nwor.nwor", "vllm_nwor.scv", "vllm_nwor.telemetry", "vllm_nwor.config")
# What the core may import of the package besides itself: the logger helper.
CORE_MAY_IMPORT = ("vllm_nwor._logging",)
FEATURE_PATCHES = ("vllm_nwor.patches.nwor", "vllm_nwor.patches.scv",
                   "vllm_nwor.patches.telemetry", "vllm_nwor.patches.synthetic")


def module_name(path: Path, root: Path = SRC) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = SRC) -> dict[str, Path]:
    return {module_name(path, root): path
            for path in sorted((root / "vllm_nwor").rglob("*.py"))}


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """Every import in ``path`` (deferred ones too): (module, names imported from it, line).
    The package uses absolute imports only (a relative one fails here)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}:{node.lineno}: a relative import"
            found.append((node.module, [alias.name for alias in node.names], node.lineno))
    return found


def in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def is_core(name: str) -> bool:
    return any(in_package(name, core) for core in CORE)


def core_violations(mods: dict[str, Path]) -> list[str]:
    bad = []
    for name, path in mods.items():
        if not is_core(name):
            continue
        for target, names, line in imports(path):
            targets = [target, *(f"{target}.{n}" for n in names)]
            if in_package(target, "vllm"):
                bad.append(f"{name}:{line} imports vLLM ({target})")
            elif in_package(target, "vllm_nwor") and not any(
                    is_core(t) or t in CORE_MAY_IMPORT for t in targets):
                bad.append(f"{name}:{line} imports {target} (outside the core)")
    return bad


def private_violations(mods: dict[str, Path]) -> list[str]:
    bad = []
    for name, path in mods.items():
        for target, names, line in imports(path):
            if target == name:
                continue
            private = [n for n in names if n.startswith("_") and n != "__future__"]
            if private and target != "__future__":
                bad.append(f"{name}:{line} imports {', '.join(private)} from {target}")
    return bad


def feature_violations(mods: dict[str, Path]) -> list[str]:
    bad = []
    for name, path in mods.items():
        own = [f for f in FEATURE_PATCHES if in_package(name, f)]
        if not own:
            continue
        for target, names, line in imports(path):
            targets = [target, *(f"{target}.{n}" for n in names)]
            others = {f for f in FEATURE_PATCHES if f != own[0]
                      for t in targets if in_package(t, f)}
            bad += [f"{name}:{line} imports {other}" for other in sorted(others)]
    return bad


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from pkg import mod`` names a module)."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        edges = set()
        for target, names, _ in imports(path):
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in mods]
            for candidate in submodules or [target]:
                if candidate in mods and candidate != name:
                    edges.add(candidate)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def package_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph without a package's edges to its own submodules (an ``__init__`` that
    re-exports its modules' names is not a cycle with them)."""
    return {name: {t for t in targets if not in_package(t, name)}
            for name, targets in graph.items()}


def test_the_core_imports_neither_vllm_nor_the_patches():
    assert core_violations(modules()) == []


def test_no_module_imports_a_private_name_from_another():
    assert private_violations(modules()) == []


def test_a_features_patches_import_no_other_features():
    assert feature_violations(modules()) == []


def test_the_package_has_no_import_cycle():
    assert cycles(package_edges(import_graph(modules()))) == []


def test_the_checks_catch_what_they_look_for(tmp_path):
    """A core module importing vLLM and the patches, a private name imported, two modules
    importing each other, and one feature's patches importing another's: each check finds its
    own."""
    fake = tmp_path / "vllm_nwor"
    (fake / "scv").mkdir(parents=True)
    (fake / "patches").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "scv" / "__init__.py").write_text("")
    (fake / "patches" / "__init__.py").write_text("")
    (fake / "scv" / "bad.py").write_text(
        "from vllm.config import VllmConfig\nfrom vllm_nwor.patches import a\n")
    (fake / "patches" / "a.py").write_text("def f():\n    from vllm_nwor.patches.b import _g\n")
    (fake / "patches" / "b.py").write_text("from vllm_nwor.patches import a\n_g = 1\n")
    for feature in ("nwor", "scv"):
        (fake / "patches" / feature).mkdir()
        (fake / "patches" / feature / "__init__.py").write_text("")
    (fake / "patches" / "scv" / "s.py").write_text(
        "from vllm_nwor.patches.nwor import binding\nfrom vllm_nwor.patches import shared\n")
    mods = modules(tmp_path)
    assert feature_violations(mods) == ["vllm_nwor.patches.scv.s:1 imports "
                                        "vllm_nwor.patches.nwor"]
    assert len(core_violations(mods)) == 2
    assert private_violations(mods) == ["vllm_nwor.patches.a:2 imports _g from "
                                        "vllm_nwor.patches.b"]
    assert cycles(package_edges(import_graph(mods))) == [
        ["vllm_nwor.patches.a", "vllm_nwor.patches.b"]]

