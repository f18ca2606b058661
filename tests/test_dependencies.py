"""A fresh install runs quietly: every module torch needs at import time is a declared dependency.

torch imports numpy at startup; without it every process (every rank of a job) prints
"Failed to initialize NumPy". pip only installs what pyproject.toml declares.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

try:
    import tomllib
except ImportError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
_NUMPY_WARNING = "Failed to initialize NumPy"


def _import_fxzero(prelude: str = "", then: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", f"{prelude}import fxzero{then}"], env=env, capture_output=True, text=True, timeout=120
    )


_LOADED_WHEN_USED = ("torch._dynamo", "torch._inductor", "torch.distributed.tensor", "torch.distributed.checkpoint", "lightning")


_HARNESS_AND_TOOLS = ("fxzero.testing", "fxzero.parity_check", "fxzero.explainer", "fxzero.compiled.ops")
_STATE = (  # what fxzero has loaded, defined and registered so far
    f"[m for m in {_HARNESS_AND_TOOLS!r} if m in sys.modules], "
    "[op for op in ('wait_params', 'grads_ready', 'module_entered') if hasattr(torch.ops.fxzero, op)], "
    "log_registry.is_log('fxzero'), logging.getLogger('fxzero').isEnabledFor(logging.INFO)"
)


def test_importing_fxzero_prints_nothing_and_loads_what_it_uses_only_when_used() -> None:
    """Nor does it import Dynamo, Inductor, DTensor or DCP (2.0 of the 3.8 s an ``import fxzero``
    took on this machine; it now takes what ``import torch`` does, ~1.8 s): ``torch.compile``, an
    optimizer over DTensor params and the checkpoint functions import them when used. A training
    process gains little from it: building any torch.optim optimizer imports Dynamo (torch.optim's
    ``add_param_group`` is wrapped by ``torch._disable_dynamo``), which the last line shows.

    Nor does it have side effects: no test harness, explain or parity loaded, no custom op
    defined, no exit handler and no torch log registered. The first optimizer (or compile)
    defines the ops and registers the ``fxzero`` log, which ``torch._logging.set_logs`` then
    sets. (``TORCH_LOGS=fxzero`` needs no registration: torch resolves the name as a module,
    importing fxzero's packages itself; ``tests/test_cli.py`` runs with it.)"""
    prelude = "import atexit, logging, sys, torch; from torch._logging._internal import log_registry; handlers = atexit._ncallbacks(); "
    then = (f"; print(atexit._ncallbacks() - handlers, {_STATE}); "
            f"print([m for m in {_LOADED_WHEN_USED!r} if m in sys.modules]); fxzero.save_checkpoint; "
            "torch.optim.SGD([torch.zeros(1, requires_grad=True)]); print('torch._dynamo' in sys.modules); "
            "fxzero.DistributedOptimizer(torch.nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1); "
            f"torch._logging.set_logs(modules={{'fxzero': logging.INFO}}); print({_STATE})")
    result = _import_fxzero(prelude, then)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    effects, loaded, dynamo, used = result.stdout.splitlines()
    assert effects == "0 [] [] False False", f"import fxzero: exit handlers added, loaded, ops, log registered, enabled: {effects}"
    assert loaded == "[]", f"import fxzero imported {loaded}"
    assert dynamo == "True"
    assert used == "['fxzero.compiled.ops'] ['wait_params', 'grads_ready', 'module_entered'] True True", used


def test_numpy_which_torch_warns_without_is_a_declared_dependency() -> None:
    hidden = _import_fxzero("import sys; sys.modules['numpy'] = None; ")  # as on a machine without numpy
    assert hidden.returncode == 0 and _NUMPY_WARNING in hidden.stderr, hidden.stderr
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    numpy = [req for req in map(Requirement, declared) if req.name == "numpy"]
    assert numpy, f"numpy is not in pyproject.toml's dependencies: {declared}"
    import numpy as np

    assert numpy[0].specifier.contains(np.__version__), (str(numpy[0]), np.__version__)


def _needs(package: str, seen: set[str]) -> set[str]:
    """``package`` and everything it installs (its requirements without an extra's marker), as installed here."""
    from importlib import metadata

    name = package.lower().replace("_", "-")
    if name in seen:
        return seen
    seen.add(name)
    for line in metadata.requires(name) or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            _needs(requirement.name, seen)
    return seen


def test_the_hf_extra_installs_no_torchvision() -> None:
    """The README's Hugging Face install (``.[hf]``) must leave ``import transformers`` working on
    a CPU torch: the one torchvision for torch 2.13 is a CUDA build that breaks it there."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["hf"]
    needed: set[str] = set()
    for line in extra:
        _needs(Requirement(line).name, needed)
    assert {"transformers", "accelerate", "torch"} <= needed and "torchvision" not in needed


def _pins(name: str) -> dict[str, str]:
    lines = (ROOT / name).read_text().splitlines()
    return {Requirement(line).name: line.split("==", 1)[1] for line in lines if "==" in line and not line.startswith("#")}


def test_pyproject_states_ranges_and_the_constraints_files_pin_versions_inside_them() -> None:
    """Installing fxzero or an extra never replaces a version inside the range an environment already
    has: pyproject.toml states ranges only. The exact versions CI and the README's commands install
    are ``constraints.txt``'s (``constraints-torch2.15.txt`` changes torch and torchvision for CI's
    second environment and nothing else), each inside its range, as is what runs here."""
    from importlib import metadata

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(line) for group in [project["dependencies"], *project["optional-dependencies"].values()] for line in group]
    assert [str(r) for r in requirements if any(s.operator in ("==", "===", "~=") for s in r.specifier)] == []
    assert all(r.specifier for r in requirements), "every requirement states the versions fxzero works with"
    pins, newest = _pins("constraints.txt"), _pins("constraints-torch2.15.txt")
    assert set(newest) == {"torch", "torchvision"}
    for requirement in requirements:
        for pinned in (pins, newest):
            if requirement.name in pinned:
                assert requirement.specifier.contains(pinned[requirement.name]), (str(requirement), pinned[requirement.name])
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            continue
        assert requirement.specifier.contains(installed, prereleases=True), (str(requirement), installed)
    extras = {r.name for group in project["optional-dependencies"].values() for r in map(Requirement, group)}
    assert extras - {"pytest", "expecttest", "hypothesis", "pytest-timeout", "matplotlib"} <= set(pins)
