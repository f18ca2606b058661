"""``torch.nn`` modules: private class names and attributes.

Part of :mod:`fxzero._torch_compat` (see its docstring: why every private torch API is there).
"""

from __future__ import annotations

import torch.nn as nn

__all__ = ["batch_norm_base", "own_params"]


def batch_norm_base() -> type[nn.Module]:
    """The base class of every batch norm (``BatchNorm1d/2d/3d``, their lazy forms,
    ``SyncBatchNorm`` and user subclasses).

    What for: ``fxzero parity`` flags batch norms in train mode (per-rank statistics make
    N ranks incomparable to a global-batch reference). Uses
    ``torch.nn.modules.batchnorm._BatchNorm`` (a private name). If torch moves it: the
    tuple of the public classes above, which misses user subclasses of the base.
    """
    from torch.nn.modules.batchnorm import _BatchNorm

    return _BatchNorm


def own_params(module: nn.Module) -> list[nn.Parameter]:
    """The params registered on ``module`` itself (not its submodules), in order, with tied
    ones repeated. ``module._parameters``: ``module.parameters(recurse=False)`` drops the
    repeats and costs a generator per call, and a forward pre-hook asks this inside every
    compiled forward. If torch renames it: ``parameters(recurse=False, remove_duplicate=False)``."""
    return [p for p in module._parameters.values() if p is not None]
