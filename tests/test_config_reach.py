"""How far ``fxzero.Config`` travels from :class:`fxzero.DistributedOptimizer`'s constructor.

The optimizer reads its configuration in one place and gives the parts plain values (a bucket
size, a flag); a part that takes the whole ``Config`` couples itself to every option, and each
such part is one more file to read to learn what an option does.

**The measurement** (static, over the package's source, no import of the modules measured):

* A *carrier* is a function that holds the ``Config`` object. The first is
  ``DistributedOptimizer.__init__`` (its ``config`` parameter). Inside a carrier the config is
  each name bound to it: the parameter it came in by, a local alias (``c = self.config``), and
  ``self.<attr>`` where the carrier stores it (``self.config = config``); storing it on ``self``
  makes every method of that class (and of the classes it names as bases) a carrier too.
* A call in a carrier that passes the config itself (positionally or by keyword) makes the
  callee a carrier, holding it under the callee's own parameter name. Callees are found by name
  among the package's functions, classes (their ``__init__``, or the class itself for a
  dataclass) and methods (``self.m(...)`` in the carrier's class, ``X.m(...)`` for a package
  class ``X``, ``obj.m(...)`` when one package method has that name, and a local name assigned
  from function names, ``f = a if c else b``).
* A call in a carrier whose argument *reads* the config (an expression mentioning
  ``config.<field>``, or a name or ``self.<attr>`` assigned from such an expression earlier in
  the same function) hands the callee a value read from the config: the callee's module is
  reached. Inside the carrier's own module the value is followed on (under the callee's
  parameter name, as the config is: ``self._build(overlap)`` then ``ParamSync(overlap=...)``);
  a callee in another module is a part that got a plain value, and what it does with it inside
  is its own. An assignment from a call of anything but the config's own methods starts no
  value: what a part's constructor (or a resolving function) returns is a part, not a value.
* The reach is the set of modules holding a function that received the config or a value read
  from it; ``fxzero/config.py`` itself (``Config``'s own methods) is not counted.

The issue's bound is 12 files."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import fxzero

PACKAGE = Path(fxzero.__file__).resolve().parent
START = ("distributed_optimizer.py", "DistributedOptimizer", "__init__")
BOUND = 12


@dataclass
class _Function:
    module: str
    owner: str | None  # the class a method belongs to
    node: ast.FunctionDef


@dataclass
class _Index:
    functions: dict[str, list[_Function]] = field(default_factory=dict)  # top-level functions by name
    classes: dict[str, tuple[str, ast.ClassDef]] = field(default_factory=dict)
    methods: dict[str, list[_Function]] = field(default_factory=dict)  # methods by name

    def method(self, cls: str, name: str) -> _Function | None:
        """``cls.name``, looked up through the bases that are package classes."""
        seen = [cls]
        while seen:
            here = seen.pop(0)
            if here not in self.classes:
                continue
            module, node = self.classes[here]
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return _Function(module, here, item)
            seen += [ast.unparse(base).split(".")[-1] for base in node.bases]
        return None


def _index(root: Path) -> _Index:
    index = _Index()
    for path in sorted(root.rglob("*.py")):
        module = str(path.relative_to(root))
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                index.functions.setdefault(node.name, []).append(_Function(module, None, node))
            elif isinstance(node, ast.ClassDef):
                index.classes[node.name] = (module, node)
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        index.methods.setdefault(item.name, []).append(_Function(module, node.name, item))
    return index


def _mentions(node: ast.AST, names: set[str]) -> bool:
    return any(ast.unparse(sub) in names for sub in ast.walk(node) if isinstance(sub, (ast.Name, ast.Attribute)))


def _reads(node: ast.AST, config: set[str], values: set[str]) -> bool:
    """Whether ``node`` reads a field of the config or uses a value read from it."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and ast.unparse(sub.value) in config:
            return True
        if isinstance(sub, (ast.Name, ast.Attribute)) and ast.unparse(sub) in values:
            return True
    return False


def _builds(node: ast.expr, config: set[str]) -> bool:
    """Whether ``node`` calls something other than the config's own methods: its result is a
    part built from values, not a value."""
    return isinstance(node, ast.Call) and not (isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) in config)


def _aliases(fn: ast.FunctionDef, name: str) -> set[str]:
    """The names a local ``name`` is assigned from (``x = a`` or ``x = a if c else b``)."""
    found = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            value = node.value
            options = [value.body, value.orelse] if isinstance(value, ast.IfExp) else [value]
            found |= {o.id for o in options if isinstance(o, ast.Name)}
    return found


def _parameters(fn: ast.FunctionDef, *, bound: bool) -> list[str]:
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    return names[1:] if bound else names


class _Reach:
    def __init__(self, root: Path) -> None:
        self.index = _index(root)
        self.carriers: dict[tuple[str, str | None, str], tuple[set[str], set[str]]] = {}
        self.todo: list[tuple[_Function, set[str], set[str]]] = []
        self.reached: dict[tuple[str, str | None, str], str] = {}  # parts handed a value, not followed into
        self.by: dict[tuple[str, str | None, str], str] = {}  # who first handed each carrier the config or a value

    def carry(self, fn: _Function, config: set[str], values: frozenset[str] = frozenset(), by: str = "") -> None:
        key = (fn.module, fn.owner, fn.node.name)
        self.by.setdefault(key, by)
        had_config, had_values = self.carriers.get(key, (set(), set()))
        if config <= had_config and values <= had_values and key in self.carriers:
            return
        self.carriers[key] = (had_config | config, had_values | values)
        self.todo.append((fn, self.carriers[key][0], self.carriers[key][1]))

    def run(self, start: _Function, names: set[str]) -> set[str]:
        self.carry(start, names, by="the constructor's parameter")
        while self.todo:
            self.visit(*self.todo.pop())
        self.by = {**self.reached, **self.by}
        return {module for module, _, _ in [*self.carriers, *self.reached]} - {"config.py"}

    def callees(self, call: ast.Call, here: _Function) -> Iterator[tuple[_Function, bool]]:
        """Package functions ``call`` may run, each with whether its first parameter is bound."""
        func = call.func
        if isinstance(func, ast.Name):
            if func.id in self.index.classes:
                init = self.index.method(func.id, "__init__")
                if init is not None:
                    yield init, True
                    return
                module, node = self.index.classes[func.id]  # a dataclass: its fields are its parameters
                fields = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
                fake = ast.FunctionDef(name="__init__", args=ast.arguments([], [ast.arg(f) for f in fields], None, [], [], None, []),
                                       body=[], decorator_list=[], lineno=0)  # fmt: skip
                yield _Function(module, func.id, fake), False
                return
            for name in {func.id} | _aliases(here.node, func.id):  # planner = plan_a if whole else plan_b
                found = self.index.functions.get(name, [])
                local = [f for f in found if f.module == here.module]  # a module's own helper, not a namesake's
                yield from ((f, False) for f in (local or found))
        elif isinstance(func, ast.Attribute):
            target = ast.unparse(func.value)
            if target == "self" and here.owner is not None:
                found = self.index.method(here.owner, func.attr)
                if found is not None:
                    yield found, True
            elif target in self.index.classes:
                found = self.index.method(target, func.attr)
                if found is not None:
                    yield found, True
            elif len(self.index.methods.get(func.attr, [])) == 1:
                yield self.index.methods[func.attr][0], True

    def visit(self, fn: _Function, config: set[str], values: set[str]) -> None:
        config, values = set(config), set(values)
        for node in ast.walk(fn.node):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = {ast.unparse(t) for t in targets if isinstance(t, (ast.Name, ast.Attribute))}
                if _mentions(node.value, config) and isinstance(node.value, (ast.Name, ast.Attribute, ast.IfExp, ast.BoolOp)) \
                        and not _reads(node.value, config, set()):  # fmt: skip
                    config |= names
                    self.store_on_self(fn, names)
                elif _reads(node.value, config, values) and not _builds(node.value, config):
                    values |= names
        for node in ast.walk(fn.node):
            if isinstance(node, ast.Call):
                self.follow(node, fn, config, values)

    def store_on_self(self, fn: _Function, names: set[str]) -> None:
        stored = {n for n in names if n.startswith("self.")}
        if stored and fn.owner is not None:
            _, cls = self.index.classes[fn.owner]
            for item in cls.body:
                if isinstance(item, ast.FunctionDef):
                    self.carry(_Function(fn.module, fn.owner, item), stored, by=f"{fn.module}: self")
            for base in cls.bases:  # a mixin reads it from self too
                name = ast.unparse(base).split(".")[-1]
                if name in self.index.classes:
                    module, node = self.index.classes[name]
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef):
                            self.carry(_Function(module, name, item), stored, by=f"{fn.module}: self")

    def follow(self, call: ast.Call, fn: _Function, config: set[str], values: set[str]) -> None:
        args = list(enumerate(call.args)) + [(k.arg, k.value) for k in call.keywords if k.arg]
        passed = {where for where, a in args if ast.unparse(a) in config}
        read = {where for where, a in args if where not in passed and _reads(a, config, values)}
        if not (passed or read):
            return
        for callee, bound in self.callees(call, fn):
            if callee.module == "config.py":
                continue
            params = _parameters(callee.node, bound=bound)
            named = {w: (params[w] if isinstance(w, int) and w < len(params) else w) for w in passed | read}
            by = f"{fn.module}:{call.lineno} {'config' if passed else ','.join(map(str, sorted(map(str, read))))}"
            values = frozenset(named[w] for w in read) if callee.module == fn.module else frozenset()
            if passed or values:
                self.carry(callee, {named[w] for w in passed}, values, by)
            else:  # a part of another module got a plain value: it is reached, what it does inside is its own
                self.reached.setdefault((callee.module, callee.owner, callee.node.name), by)


def config_reach(root: Path = PACKAGE) -> list[str]:
    """The modules (paths under ``root``) the constructor's config reaches, as the docstring defines."""
    return sorted({path.split(" ")[0] for path in config_stops(root)})


def config_stops(root: Path = PACKAGE) -> list[str]:
    """Each function reached, ``module Class.function <- caller:line what it was handed``."""
    reach = _Reach(root)
    module, cls, method = START
    start = reach.index.method(cls, method)
    assert start is not None and start.module == module
    reach.run(start, {"config"})
    return sorted(f"{m} {o + '.' if o else ''}{f} <- {by}" for (m, o, f), by in reach.by.items() if m != "config.py")


def test_config_reaches_at_most_twelve_files() -> None:
    files = config_reach()
    assert "distributed_optimizer.py" in files
    stops = "\n".join(config_stops())
    assert len(files) <= BOUND, f"Config reaches {len(files)} files (bound {BOUND}): {files}\n{stops}"


def test_config_reach_follows_the_config_and_values_read_from_it(tmp_path: Path) -> None:
    (tmp_path / "distributed_optimizer.py").write_text(
        "class DistributedOptimizer:\n"
        "    def __init__(self, config):\n"
        "        self.config = config\n"
        "        build(self.config)\n"
        "    def later(self):\n"
        "        size = self.config.bucket_size\n"
        "        Part(size)\n"
    )
    (tmp_path / "build.py").write_text("def build(cfg):\n    flag = cfg.flag\n    use(flag)\n    other(3)\n")
    (tmp_path / "use.py").write_text("def use(flag):\n    pass\n")
    (tmp_path / "other.py").write_text("def other(n):\n    pass\n")
    (tmp_path / "part.py").write_text("class Part:\n    def __init__(self, size):\n        pass\n")
    assert config_reach(tmp_path) == ["build.py", "distributed_optimizer.py", "part.py", "use.py"]
