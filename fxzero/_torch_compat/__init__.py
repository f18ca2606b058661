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

from .autograd import *  # noqa: F403
from .autograd import __all__ as _autograd
from .distributed import *  # noqa: F403
from .distributed import __all__ as _distributed
from .dtensor import *  # noqa: F403
from .dtensor import __all__ as _dtensor
from .dynamo import *  # noqa: F403
from .dynamo import __all__ as _dynamo
from .inductor import *  # noqa: F403
from .inductor import __all__ as _inductor
from .modules import *  # noqa: F403
from .modules import __all__ as _modules
from .optimizer import *  # noqa: F403
from .optimizer import __all__ as _optimizer
from .tensors import *  # noqa: F403
from .tensors import __all__ as _tensors

TORCH_VERSIONS = ">=2.11,<2.14"
"""The torch releases fxzero runs on, as pyproject's requirement spells it: 2.13 (what CI
installs) and 2.11 (the build the lent GPU machines carry)."""

__all__ = ["TORCH_VERSIONS", *_autograd, *_distributed, *_dtensor, *_dynamo, *_inductor, *_modules, *_optimizer, *_tensors]
