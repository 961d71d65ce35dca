"""The import structure: storage/ imports nothing above it, and no module-level import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "hcapo_store"
ABOVE_STORAGE = (
    "ingestion",
    "rendering",
    "scoring",
    "credits",
    "outputs",
    "analysis",
    "cli",
    "devkit",
    "training",
    "online",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.If) and top_level_only:  # `if TYPE_CHECKING:` imports load nothing
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith("hcapo_store")}


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    return {
        name: {m for m in _imports(path, top_level_only=top_level_only) if m in modules and m != name}
        for name, path in modules.items()
    }


def test_storage_imports_nothing_above_it():
    upward = [
        f"{name} -> {target}"
        for name, targets in _graph(top_level_only=False).items()
        if name.startswith("hcapo_store.storage")
        for target in targets
        if target.split(".")[1] in ABOVE_STORAGE
    ]
    assert upward == []


def test_rendering_sits_below_scoring_outputs_and_training():
    """rendering/ (conversation -> text -> ids) is what scoring, outputs and training build on:
    it imports none of them, nor the database (a rendering needs no store)."""
    above = ("storage", "ingestion", "scoring", "credits", "outputs", "analysis", "cli", "devkit", "training", "online")
    upward = [
        f"{name} -> {target}"
        for name, targets in _graph(top_level_only=False).items()
        if name.startswith("hcapo_store.rendering")
        for target in targets
        if target.split(".")[1] in above
    ]
    assert upward == []


def test_the_pipeline_never_imports_the_trainers():
    """training/ reads exports and needs torch/TRL: nothing else may depend on it. The package's
    facade (hcapo_store/__init__.py) names its framework-free hand-off for static tools only and
    loads it on first use, so ``import hcapo_store`` stays light (test_public_api)."""
    users = [
        f"{name} -> {target}"
        for name, targets in _graph(top_level_only=False).items()
        if not name.startswith("hcapo_store.training")
        for target in targets
        if target.startswith("hcapo_store.training")
        and not (name == "hcapo_store" and target in ("hcapo_store.training.handoff", "hcapo_store.training.adapters"))
    ]
    assert users == []


def test_training_reads_no_outputs():
    """training/ meets trainers on its own floor: what it shares with the exports (the rendering
    and alignment, the scorer's tokenizer lookup, a run's weights, the tokenized columns) lives
    below both, in rendering/, scoring/ and credits/; it never reads through outputs/."""
    through = [
        f"{name} -> {target}"
        for name, targets in _graph(top_level_only=False).items()
        if name.startswith("hcapo_store.training")
        for target in targets
        if target.startswith("hcapo_store.outputs")
    ]
    assert through == []


def test_no_module_level_import_cycle():
    graph = _graph(top_level_only=True)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            # a package importing its own submodules (hcapo_store.cli -> hcapo_store.cli.main) is no cycle
            if len(component) > 1 and not all(c.startswith(min(component, key=len)) for c in component):
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []
