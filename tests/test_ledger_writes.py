"""The readiness ledger is the only writer of its state: no module of fxzero but
``optim/gradients/ledger.py`` writes a field of a ledger. Callers report events through its
methods (``eager_grad``, ``compiled_grads``, ``no_sync``, ``grad_assigned``, ...) and read
its flags through read-only properties; this check reads the source, so a write that the
properties cannot stop (``ledger.presence_tensor.fill_(1)``) fails here, naming file:line.

A write is an assignment (plain, augmented, annotated, ``del``, ``setattr``) to a name
below a ledger (``self.ledger.x = ...``, ``ledger.x[i] = ...``, ``setattr(self.ledger, ...)``),
or an in-place method called on a ledger's field (``.fill_``, ``.copy_``, ``.zero_``,
``index_fill_`` or any other ``name_``; ``__setitem__``, ``extend``, ...). A ledger is any
name or attribute spelt ``ledger`` or ``_ledger``. Holding a ledger
(``self.ledger = Ledger(...)``) or calling its methods is no write."""

from __future__ import annotations

import ast
from pathlib import Path

import fxzero

PACKAGE = Path(fxzero.__file__).parent
OWNER = PACKAGE / "optim" / "gradients" / "ledger.py"
LEDGER_NAMES = frozenset({"ledger", "_ledger"})
MUTATORS = frozenset({"__setitem__", "__delitem__", "__iadd__", "__ior__", "append", "extend", "insert", "pop", "remove", "clear", "update"})


def _chain(node: ast.expr) -> list[str]:
    """``self.ledger.presence[span]`` -> ``["self", "ledger", "presence", "[]"]``."""
    names: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript):
            names.append("[]")
            node = node.value
        elif isinstance(node, ast.Call):  # getattr(...) or a call's result: look through
            names.append("()")
            node = node.func
        else:
            names.append(node.id if isinstance(node, ast.Name) else "?")
            return names[::-1]


def _below_a_ledger(node: ast.expr, names: frozenset[str] = LEDGER_NAMES) -> bool:
    """Whether ``node`` names something inside a ledger (not the ledger itself); ``names``: how
    the part is spelt (a ledger's by default)."""
    chain = _chain(node)
    return any(name in names for name in chain[:-1])


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    elif isinstance(node, ast.Delete):
        found = list(node.targets)
    else:
        return []
    flat: list[ast.expr] = []
    while found:  # unpack tuple targets: `previous, self.ledger.x = ...`
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        elif isinstance(target, ast.Starred):
            found.append(target.value)
        else:
            flat.append(target)
    return flat


def _is_write(node: ast.AST, names: frozenset[str] = LEDGER_NAMES) -> bool:
    if any(isinstance(t, (ast.Attribute, ast.Subscript)) and _below_a_ledger(t, names) for t in _targets(node)):
        return True
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args:
        target = node.args[0]
        return _chain(target)[-1] in names or _below_a_ledger(target, names)
    if isinstance(func, ast.Attribute):
        in_place = (func.attr.endswith("_") and not func.attr.startswith("__")) or func.attr in MUTATORS
        receiver = func.value  # the in-place method's object: a field of a ledger, not the ledger
        return in_place and isinstance(receiver, (ast.Attribute, ast.Subscript)) and _below_a_ledger(receiver, names)
    return False


def ledger_writes(root: Path, owner: Path, names: frozenset[str] = LEDGER_NAMES) -> list[str]:
    """``file:line: source`` of each write to a ledger's field (or to that of the part spelt
    ``names``) under ``root`` outside ``owner``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == owner:
            continue
        source = path.read_text()
        writes = sorted((node.lineno, ast.get_source_segment(source, node)) for node in ast.walk(ast.parse(source)) if _is_write(node, names))
        found += [f"{path.relative_to(root.parent)}:{line}: {text}" for line, text in writes]
    return found


def test_no_module_but_the_ledger_writes_its_fields() -> None:
    found = ledger_writes(PACKAGE, OWNER)
    assert not found, "only optim/gradients/ledger.py writes a ledger's fields; add a ledger method for:\n" + "\n".join(found)


PLANTED = """\
def report(self, ledger, span, opt):
    self.ledger = Ledger()
    self.ledger.start_step()
    with self.ledger.no_sync():
        ledger.eager_grad(0)
    ledger.written = True
    self.ledger.presence[span] = b"1"
    previous, self.ledger.accumulating = self.ledger.accumulating, True
    opt.ledger.learning |= True
    self.ledger.presence_tensor.index_fill_(0, span, 1)
    opt._ledger.presence_tensor[0:2].zero_()
    setattr(self.ledger, "written", False)
    del ledger.compiled
    opt.ledger.compiled.__setitem__(0, 1)
    x = opt.ledger.presence_tensor.sum()
"""


def test_the_check_names_each_planted_write(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "optim").mkdir(parents=True)
    (package / "optim" / "caller.py").write_text(PLANTED)
    (package / "ledger.py").write_text("def own(self):\n    self.presence[0] = 1\n    self._written = True\n")
    found = ledger_writes(package, package / "ledger.py")
    assert [line.split(": ")[0] for line in found] == [f"pkg/optim/caller.py:{n}" for n in range(6, 15)]
    assert "pkg/optim/caller.py:6: ledger.written = True" in found
