"""The package layout as a rule (docs/design.md, "Layout"): every import of the project's code,
at module level or inside a function, read from the source with ``ast``.

- Between the top-level packages: benchmarks -> engine -> models -> parallel -> kernels, never
  back (nothing of the engine imports a benchmark).
- Inside engine/: each subsystem imports only the subsystems below it (``ENGINE_LAYERS``); the
  entry-point modules (``python -m engine.train`` and the others, and a package's ``__main__``:
  ``python -m engine.plan``) may import anything.
- No import circle between modules, counting that importing ``a.b.c`` runs ``a/__init__.py`` and
  ``a/b/__init__.py`` first.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("benchmarks", "engine", "models", "parallel", "kernels")
# what each top-level package may import of the others
TOP_ALLOWED = {"benchmarks": {"engine", "models", "parallel", "kernels"},
               "engine": {"models", "parallel", "kernels"}, "models": {"parallel", "kernels"},
               "parallel": {"kernels"}, "kernels": set()}
# engine's subsystems, lowest first; each may import those named in its set
ENGINE_LAYERS = {
    "base": set(),
    "device": {"base"},
    "data": {"base"},
    "plan": {"base"},
    "config": {"base", "data"},
    "checkpoint": {"base", "config", "data"},
    "observe": {"base", "config", "data", "device", "plan"},
    "training": {"base", "config", "data", "device", "plan", "checkpoint", "observe"},
    "tools": {"base", "config", "data", "device", "plan", "checkpoint", "observe"},
    "dryrun": {"base", "config", "data", "device", "plan", "checkpoint", "observe", "training"},
    "fuzz": {"base", "config", "data", "device", "plan", "checkpoint", "observe", "training"},
}
ENTRY_POINTS = {"train", "generate", "preflight", "export", "import_hf"}  # engine/<name>.py


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (absolute and relative, wherever the import stands)."""
    out = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t.split(".")[0] in PACKAGES)
    return out


def graph() -> dict[str, set[str]]:
    mods = source_modules()
    known = set(mods)
    edges = {}
    for name, path in mods.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        deps = set()
        for target in imports_of(name, path, known):
            parts = target.split(".")
            # importing a.b.c runs a/__init__ and a/b/__init__ first (not ours: already running)
            deps.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        edges[name] = {d for d in deps if d in known and d != name and d not in own}
    return edges


def subsystem(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "engine" or len(parts) == 1:
        return None
    return parts[1]


def test_top_level_direction():
    wrong = [f"{m} imports {d}" for m, deps in graph().items() for d in deps
             if d.split(".")[0] != m.split(".")[0] and d.split(".")[0] not in TOP_ALLOWED[m.split(".")[0]]]
    assert not wrong, ("imports against benchmarks -> engine -> models -> parallel -> kernels:\n"
                       + "\n".join(sorted(wrong)))


def test_engine_subsystems_import_only_below_them():
    mods = source_modules()
    packages = {subsystem(m) for m in mods if subsystem(m)}
    assert packages - ENGINE_LAYERS.keys() <= ENTRY_POINTS, \
        f"engine/ has modules outside the layers: {sorted(packages - ENGINE_LAYERS.keys() - ENTRY_POINTS)}"
    wrong = []
    for m, deps in graph().items():
        own = subsystem(m)
        if own is None or own in ENTRY_POINTS or m.endswith(".__main__"):
            continue
        for d in deps:
            other = subsystem(d)
            if other and other != own and other not in ENGINE_LAYERS[own]:
                wrong.append(f"{m} imports {d} ({own} may import only {sorted(ENGINE_LAYERS[own]) or 'nothing'})")
    assert not wrong, "imports against engine's layers:\n" + "\n".join(sorted(wrong))


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_circle():
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_checker_finds_what_it_looks_for(tmp_path):
    """The checks fail on the faults they exist for: a circle, an import inside a function, a
    relative import, and an edge against the layers."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    src = tmp_path / "probe.py"
    src.write_text("import os\nfrom . import recipe\nfrom .schema import RunConfig\n"
                   "def f():\n    from engine.training.trainer import Trainer\n")
    known = {"engine.config.recipe", "engine.config.schema", "engine.training.trainer"}
    assert imports_of("engine.config.probe", src, known) == {
        "engine.config.recipe", "engine.config.schema", "engine.training.trainer"}
    edges = graph()
    assert "engine.config.schema" in edges["engine.config.cli"]
    assert "engine.data" in edges["engine.config.schema"]  # importing engine.data.blend runs engine/data/__init__
    assert subsystem("engine.training.trainer") == "training" and "training" not in ENGINE_LAYERS["observe"]


@pytest.mark.parametrize("package", [p for p in ENGINE_LAYERS if p != "base"])
def test_every_subsystem_says_what_it_owns(package):
    init = ROOT / "engine" / package / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text())) if init.exists() else None
    assert doc and len(doc.split()) >= 12, f"engine/{package}/__init__.py needs a docstring saying what it owns"


@pytest.mark.parametrize("folder", sorted(p.parent.name for p in (ROOT / "benchmarks").glob("*/__init__.py")))
def test_every_benchmark_folder_says_what_it_measures(folder):
    init = ROOT / "benchmarks" / folder / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text()))
    modules = sorted(p.stem for p in init.parent.glob("*.py") if not p.stem.startswith("__"))
    assert doc and all(f"``{m}``" in doc for m in modules), \
        f"benchmarks/{folder}/__init__.py needs a docstring naming each of its modules {modules}"
