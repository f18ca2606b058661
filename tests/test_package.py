"""The package's shape: no import cycles between fxzero's modules, no import from a room
(a folder or top-level module of ``fxzero/``) to a higher one, and every private torch
API (a ``torch._*`` name or module) used through ``fxzero/_torch_compat.py`` only."""

from __future__ import annotations

import ast
from pathlib import Path

import fxzero

PACKAGE = Path(fxzero.__file__).resolve().parent
COMPAT = PACKAGE / "_torch_compat.py"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.Module) -> list[ast.ImportFrom | ast.Import]:
    """Imports executed when the module is imported: top level, not under TYPE_CHECKING."""
    found: list[ast.ImportFrom | ast.Import] = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            found += [n for n in node.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    return found


def _targets(module: str, is_package: bool, node: ast.ImportFrom | ast.Import, known: set[str]) -> set[str]:
    """fxzero modules (packages included: importing ``a.b`` runs ``a/__init__``) an import loads."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)] if node.level else []
        root = ".".join(base + ([node.module] if node.module else []))
        names = [root] + [f"{root}.{alias.name}" for alias in node.names]
    loaded = set()
    for name in names:
        parts = name.split(".")
        loaded |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {name for name in loaded if name in known}


def _import_graph() -> dict[str, set[str]]:
    files = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text())
        edges = set()
        for node in _runtime_imports(tree):
            edges |= _targets(module, path.name == "__init__.py", node, set(files))
        ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        graph[module] = edges - {module} - ancestors  # a package's __init__ always runs before its modules
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_between_fxzero_modules() -> None:
    graph = _import_graph()
    assert "fxzero.compiled.ops" in graph and "fxzero.distributed_optimizer" in graph["fxzero"]
    assert _cycles(graph) == []


def test_cycle_finder_sees_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


LAYERS = (
    ("_torch_compat", "config", "version", "help_text"),
    ("optim.communication",),  # the runtime's parts, by phase: the process group and the ranks' meeting
    ("optim.layout",),  # where params lie: plans, param table, buffers, shard views
    ("optim.state", "optim.params"),  # the wrapped optimizer's state; params after the step (the gather protocol)
    ("optim.gradients", "optim.update"),  # backward to step: ledger, reductions, p.grad views; the update
    ("optim",),  # what the parts export
    ("mxfp8", "compiled", "torch_log"),  # implements the gather protocol; what compiled graphs call (ops, binding, graph ids); the fxzero torch log
    ("runtime",),  # assembles the parts in one function (chooses the gather, lets the ops take DTensor params)
    ("distributed_optimizer",),  # lays out the buffers and param table, builds the runtime, steps it
    ("passes",),
    ("dump",),
    ("graph_compiler",),
    ("backend",),
    ("checkpoint", "testing", "target", "hugging_face", "lightning"),
    ("explainer", "parity_check"),
    ("cli", "fxzero"),
    ("__main__",),
)
"""Rooms from the bottom up: a room imports only rooms of lower layers."""


def _room(module: str) -> str:
    """A top-level module or folder of the package; inside ``optim``, each phase's sub-package."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "optim":
        return f"optim.{parts[2]}"
    return parts[1] if len(parts) > 1 else parts[0]


def _upward_imports(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    level = {room: i for i, rooms in enumerate(layers) for room in rooms}
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            low, high = _room(target), _room(module)
            if low != high and level[low] >= level[high]:
                found.append(f"{module} -> {target}")
    return found


def test_every_room_has_a_layer_and_no_import_goes_up() -> None:
    graph = _import_graph()
    placed = {room for rooms in LAYERS for room in rooms}
    assert {_room(m) for m in graph} - placed == set(), "place the new room in LAYERS"
    assert _upward_imports(graph, LAYERS) == []


def test_upward_import_finder_sees_one() -> None:
    graph = {"fxzero.optim.layout.a": {"fxzero.mxfp8.b"}, "fxzero.mxfp8.b": {"fxzero.optim.layout.c"}, "fxzero.optim.layout.c": set()}
    assert _upward_imports(graph, (("optim.layout",), ("mxfp8",))) == ["fxzero.optim.layout.a -> fxzero.mxfp8.b"]
    inside = {"fxzero.optim.layout.a": {"fxzero.optim.gradients.b"}, "fxzero.optim.gradients.b": set()}
    assert _upward_imports(inside, (("optim.layout",), ("optim.gradients",))) == ["fxzero.optim.layout.a -> fxzero.optim.gradients.b"]


def _is_dotted_name(node: ast.expr) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def _private_torch_names(tree: ast.Module) -> list[str]:
    """Dotted ``torch...`` names (attributes and imports) with a ``_private`` part."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.Attribute) and _is_dotted_name(node):
            names.append(ast.unparse(node))
    private = []
    for name in names:
        parts = name.split(".")
        if parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts):
            private.append(name)
    return private


def test_private_torch_apis_only_in_the_compat_module() -> None:
    found = {
        str(path.relative_to(PACKAGE)): sorted(set(_private_torch_names(ast.parse(path.read_text()))))
        for path in PACKAGE.rglob("*.py")
        if path != COMPAT
    }
    assert {path: names for path, names in found.items() if names} == {}
    assert _private_torch_names(ast.parse(COMPAT.read_text()))  # the compat module is where they are


def test_the_version_is_one_and_the_console_script_prints_it() -> None:
    """``fxzero.__version__``, pyproject.toml's version, the changelog's newest entry and
    ``fxzero --version`` (the console script the README's install puts on PATH) agree."""
    import shutil
    import subprocess

    try:
        import tomllib
    except ImportError:  # Python 3.10: pytest itself depends on tomli there
        import tomli as tomllib  # type: ignore[no-redef]

    root = Path(__file__).resolve().parents[1]
    version = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    assert fxzero.__version__ == version
    assert (root / "CHANGELOG.md").read_text().split("\n## ")[1].startswith(f"{version} ")
    script = shutil.which("fxzero")
    assert script is not None, "pip install -e . puts the fxzero console script on PATH"
    run = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=120, check=True)
    assert run.stdout.strip() == f"fxzero {version}"


def test_no_module_keeps_a_counter_of_the_process() -> None:
    """Graphs were once numbered by three module-level counters that disagreed; a compiled
    graph is named by its Dynamo compile id now (``fxzero/compiled/graph_id.py``)."""
    counters = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            if isinstance(value, ast.Call) and ast.unparse(value.func).endswith(("itertools.count", "count")):
                counters.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    assert counters == []
