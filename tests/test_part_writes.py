"""No part of the runtime has its fields written from outside its own module (the ledger's
check, ``tests/test_ledger_writes.py``, applied to every part the step goes through): a phase
that changes a part's state is a method of that part (``sharded_state.begin_step()``, not
``sharded_state.consolidated = None``), so a reader finds every change of a part's state in
its module. A part is found by how fxzero spells it (``self.sharded_state``, ``rt.reduced``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_ledger_writes import PACKAGE, ledger_writes

PARTS = {
    "sharded_state": "optim/state/sharded_state.py",
    "rank_state": "optim/state/rank_state.py",
    "reduced": "optim/gradients/reduced_grads.py",
    "reductions": "optim/gradients/grad_reductions.py",
    "grad_sync": "optim/gradients/grad_sync.py",
    "grad_views": "optim/gradients/grad_views.py",
    "param_sync": "optim/params/param_sync.py",
    "param_watch": "optim/params/param_watch.py",
    "buffer_sync": "optim/params/buffer_sync.py",
    "publish": "optim/update/publish.py",
}
"""Each part's name (as an attribute or a variable) -> the module that alone writes its fields."""


@pytest.mark.parametrize(("name", "owner"), sorted(PARTS.items()))
def test_no_module_but_its_own_writes_a_parts_fields(name: str, owner: str) -> None:
    found = ledger_writes(PACKAGE, PACKAGE / owner, frozenset({name, f"_{name}"}))
    assert not found, f"only {owner} writes a {name}'s fields; add a method there for:\n" + "\n".join(found)


def test_the_check_names_a_write_to_a_parts_field(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "step.py").write_text("def step(rt):\n    rt.sharded_state.begin_step()\n    rt.sharded_state.consolidated = None\n")
    found = ledger_writes(package, package / "sharded_state.py", frozenset({"sharded_state"}))
    assert found == ["pkg/step.py:3: rt.sharded_state.consolidated = None"]
