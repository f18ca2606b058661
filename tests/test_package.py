"""The package's shape: no import cycles between fxzero's modules, no import from a room
(a folder or top-level module of ``fxzero/``) to a higher one, and every private torch
API (a ``torch._*`` name or module, a private attribute of a torch object, a private torch
class's name) used through the compat package ``fxzero/_torch_compat/`` only."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import torch

import fxzero

PACKAGE = Path(fxzero.__file__).resolve().parent
COMPAT = PACKAGE / "_torch_compat"


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
    ("_torch_compat", "config", "version", "help_text", "rng"),
    ("inductor_function",),  # a function compiled once per process by Inductor, its compiles counted (the update's loops)
    ("optim.communication",),  # the runtime's parts, by phase: the process group and the ranks' meeting
    ("optim.layout",),  # where params lie: plans, param table, buffers, shard views
    ("optim.state", "optim.params"),  # the wrapped optimizer's state; params after the step (the gather protocol)
    ("optim.gradients", "optim.update"),  # backward to step: ledger, the reduction protocol, p.grad views; the update, publish
    ("optim",),  # what the parts export
    ("mxfp8", "compiled", "torch_log"),  # implements the gather protocol; what compiled graphs call (ops, binding, graph ids); the fxzero torch log
    ("runtime",),  # assembles the parts in one function (chooses the gather and the reduction, lets the ops take DTensor params); the update and end phases
    ("distributed_optimizer",),  # lays out the buffers and param table, builds the runtime, steps it
    ("passes",),
    ("dump",),
    ("graph_compiler",),
    ("backend",),
    ("checkpoint", "testing", "target", "hugging_face", "lightning", "model_output"),
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


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@functools.lru_cache(maxsize=1)
def torch_private_attributes() -> frozenset[str]:
    """The ``_private`` attribute names torch defines on the objects fxzero handles: tensors,
    params, modules, optimizers, DTensors, FX graphs and nodes, autograd nodes, process
    groups, hook handles. Read from the classes and from instances (a module's
    ``_parameters``, an optimizer's hook dicts are set in ``__init__``), so a torch upgrade
    that adds one is covered without editing this list."""
    import torch.fx as fx
    from torch.distributed.tensor import DTensor

    param = torch.nn.Parameter(torch.zeros(2))
    module = torch.nn.Linear(1, 1)
    traced = fx.symbolic_trace(module)
    objects = [
        torch.Tensor, param, module, torch.optim.SGD([param]), DTensor, traced, traced.graph,
        next(iter(traced.graph.nodes)), (param * 2).sum().grad_fn, torch.autograd.graph.Node,
        torch.distributed.ProcessGroup, torch.utils.hooks.RemovableHandle,
    ]  # fmt: skip
    return frozenset(name for obj in objects for name in dir(obj) if _is_private(name))


@functools.lru_cache(maxsize=1)
def torch_private_class_names() -> frozenset[str]:
    """Names of classes that only torch's private modules define (``CompiledFunction`` of
    ``torch._functorch._aot_autograd.runtime_wrappers``): a string naming one (a match on an
    autograd node's name) depends on torch's internals as much as an import would. Found by
    reading the ``class`` lines of every private module's source (a quarter of a second),
    less the names torch also exports publicly and those fxzero defines itself."""
    root = Path(torch.__file__).resolve().parent
    pattern = re.compile(r"^\s*class\s+([A-Za-z_]\w*)", re.MULTILINE)
    names: set[str] = set()
    for path in root.rglob("*.py"):
        if any(_is_private(part) for part in path.relative_to(root).parts):
            names |= set(pattern.findall(path.read_text(errors="replace")))
    public = {name for module in (torch, torch.nn, torch.optim, torch.fx, torch.autograd, torch.distributed, torch.utils.data) for name in dir(module)}
    own = {node.name for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    return frozenset(names - public - own)


def _own_attributes(cls: ast.ClassDef) -> set[str]:
    """Names a class of fxzero's defines itself: methods, class-level names, ``self.x = ...``."""
    own = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            own.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and ast.unparse(node.value) == "self":
            own.add(node.attr)
    for node in cls.body:
        if isinstance(node, ast.Assign):
            own |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return own


def private_torch_attributes(tree: ast.Module) -> list[str]:
    """Reads and writes of torch's private attributes (``module._parameters``, ``t._version``)
    and strings naming them or a private torch class (``getattr(t, "_version")``,
    ``operator.attrgetter("_backward_hooks")``, ``name.startswith("CompiledFunction")``).
    ``self._x`` is fxzero's own where the enclosing class defines ``_x`` itself."""
    attributes, classes = torch_private_attributes(), torch_private_class_names()
    allowed: set[int] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        own = _own_attributes(cls)
        allowed |= {
            id(node)
            for node in ast.walk(cls)
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) in ("self", "cls") and node.attr in own
        }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in attributes and id(node) not in allowed:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in attributes | classes:
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


def _outside_compat() -> list[Path]:
    return [path for path in PACKAGE.rglob("*.py") if COMPAT not in path.parents]


def test_private_torch_apis_only_in_the_compat_module() -> None:
    found = {str(path.relative_to(PACKAGE)): sorted(set(_private_torch_names(ast.parse(path.read_text())))) for path in _outside_compat()}
    assert {path: names for path, names in found.items() if names} == {}
    inside = [name for path in COMPAT.rglob("*.py") for name in _private_torch_names(ast.parse(path.read_text()))]
    assert inside  # the compat module is where they are


def test_private_torch_attributes_only_in_the_compat_module() -> None:
    found = {str(path.relative_to(PACKAGE)): private_torch_attributes(ast.parse(path.read_text())) for path in _outside_compat()}
    assert {path: names for path, names in found.items() if names} == {}
    inside = [name for path in COMPAT.rglob("*.py") for name in private_torch_attributes(ast.parse(path.read_text()))]
    assert {"_backward_hooks", "_version", "_local_tensor", "_parameters", "CompiledFunction"} <= {n.split(": ", 1)[1].strip("'").rsplit(".", 1)[-1] for n in inside}


def test_private_attribute_finder_sees_torch_attributes_and_not_fxzeros_own() -> None:
    assert {"_parameters", "_buffers", "_modules", "_backward_hooks", "_version", "_base", "_local_tensor", "_spec"} <= torch_private_attributes()
    assert "CompiledFunction" in torch_private_class_names() and "Tensor" not in torch_private_class_names()
    planted = """
import operator
def hooks(module, t, node):
    module._parameters["w"] = t._version
    return getattr(t, "_local_tensor"), operator.attrgetter("_backward_hooks"), node.name().startswith("CompiledFunction")
class Sync:
    def __init__(self, module):
        self._buffers = []
    def broadcast(self):
        return self._buffers, self.module._buffers
class Hooked(Sync):
    def read(self):
        return self._modules
"""
    assert sorted(private_torch_attributes(ast.parse(planted))) == [
        "line 10: self.module._buffers", "line 13: self._modules", "line 4: module._parameters", "line 4: t._version",
        "line 5: 'CompiledFunction'", "line 5: '_backward_hooks'", "line 5: '_local_tensor'",
    ]  # fmt: skip


def test_the_version_is_one_and_the_console_script_prints_it() -> None:
    """``fxzero.__version__``, pyproject.toml's version, the changelog's newest release (below an
    ``Unreleased`` section, if any) and ``fxzero --version`` (the console script the README's
    install puts on PATH) agree."""
    import shutil
    import subprocess

    try:
        import tomllib
    except ImportError:  # Python 3.10: pytest itself depends on tomli there
        import tomli as tomllib  # type: ignore[no-redef]

    root = Path(__file__).resolve().parents[1]
    version = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    assert fxzero.__version__ == version
    sections = (root / "CHANGELOG.md").read_text().split("\n## ")[1:]
    released = sections[1:] if sections[0].startswith("Unreleased\n") else sections  # changes not yet in a release
    assert released[0].startswith(f"{version} ")
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
