"""Every private torch API (``torch._*`` names and modules, private attributes of torch's
objects, private class names) fxzero uses, in one place.

Why: private APIs move between torch releases without notice. Keeping them here makes a
torch upgrade one package to read: each entry says what fxzero needs it for and what would
replace it if torch moved or removed it. One module per part of torch; the rest of fxzero
imports from this package only (``tests/test_package.py`` enforces both).

Checked against the torch releases in :data:`TORCH_VERSIONS`, pyproject's requirement
(``tests/test_torch_compat.py`` checks they agree): where an API differs between them, the
entry takes each release's shape, and says which release has which.
"""

from __future__ import annotations

import re

import torch

TORCH_VERSIONS = ">=2.11,<2.16"
"""The torch releases fxzero runs on, as pyproject's requirement spells it: 2.13 (what CI
installs), 2.15 (the newest release, CI's second environment), 2.14 (its fast tier run by
hand) and 2.11 (the build the lent GPU machines carry)."""

NEWEST_VERIFIED = "2.15.0"
"""The newest torch release the test suite has run on (``constraints-torch2.15.txt``'s pin)."""


def _release(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def unsupported_torch_message(version: str) -> str | None:
    """The one-sentence refusal for torch ``version`` (``torch.__version__``), or None inside
    :data:`TORCH_VERSIONS`. Each release there has its branches in this package; one outside it
    would fail deep inside a compile (a moved private API), so ``import fxzero`` refuses it."""
    low, high = (_release(bound) for bound in re.findall(r"\d+\.\d+", TORCH_VERSIONS))
    if low <= _release(version) < high:
        return None
    return (
        f"fxzero supports torch{TORCH_VERSIONS} (the newest release verified is {NEWEST_VERIFIED}), "
        f"and this is torch {version}: install a torch in that range."
    )


_refusal = unsupported_torch_message(str(torch.__version__))
if _refusal is not None:
    raise ImportError(_refusal)

from .autograd import *  # noqa: F403
from .autograd import __all__ as _autograd
from .distributed import *  # noqa: F403
from .distributed import __all__ as _distributed
from .dtensor import *  # noqa: F403
from .dtensor import __all__ as _dtensor
from .dynamo import *  # noqa: F403
from .fake import *  # noqa: F403
from .fake import __all__ as _fake
from .dynamo import __all__ as _dynamo
from .inductor import *  # noqa: F403
from .inductor import __all__ as _inductor
from .modules import *  # noqa: F403
from .modules import __all__ as _modules
from .optimizer import *  # noqa: F403
from .optimizer import __all__ as _optimizer
from .tensors import *  # noqa: F403
from .tensors import __all__ as _tensors

__all__ = ["NEWEST_VERIFIED", "TORCH_VERSIONS", "unsupported_torch_message", *_autograd, *_distributed, *_dtensor, *_dynamo, *_fake, *_inductor, *_modules, *_optimizer, *_tensors]
