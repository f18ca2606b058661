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


def _import_fxzero(prelude: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", f"{prelude}import fxzero"], env=env, capture_output=True, text=True, timeout=120
    )


def test_importing_fxzero_prints_nothing() -> None:
    result = _import_fxzero()
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_numpy_which_torch_warns_without_is_a_declared_dependency() -> None:
    hidden = _import_fxzero("import sys; sys.modules['numpy'] = None; ")  # as on a machine without numpy
    assert hidden.returncode == 0 and _NUMPY_WARNING in hidden.stderr, hidden.stderr
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    numpy = [req for req in map(Requirement, declared) if req.name == "numpy"]
    assert numpy, f"numpy is not in pyproject.toml's dependencies: {declared}"
    import numpy as np

    assert numpy[0].specifier.contains(np.__version__), (str(numpy[0]), np.__version__)
