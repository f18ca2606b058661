"""What the precision options (narrow moments, bf16 remainders, rounding) ask of the optimizer and the params.

Why here and not in the assembler: each refusal names an option and what it needs of the
update (fxzero's own Adam update, :mod:`.shard_adam`, takes Adam and AdamW only, without
some flags) or of the params (bf16 for remainders and rounding), so it sits beside the
update it protects; :func:`~fxzero.runtime.build_runtime` calls it once, before any part is built.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ...config import Config
from ..layout.param_table import ParamTable
from .shard_adam import ADAM_CLASSES, UNSUPPORTED_FLAGS

__all__ = ["check_precision"]


def check_precision(config: Config, optimizer_class: type, groups: Sequence[dict[str, Any]], table: ParamTable, *, own_update: bool) -> None:
    """Refuse precision options this optimizer or these params cannot have, naming them
    (``own_update``: whether fxzero's own Adam update steps, :mod:`.shard_adam`)."""
    option = _precision_option(config)
    if own_update and optimizer_class not in ADAM_CLASSES:
        raise ValueError(
            f"fxzero: {option} steps with fxzero's own Adam update, which only torch.optim.Adam and torch.optim.AdamW have; "
            f"{optimizer_class.__name__} keeps its state as it defines it (leave {option.split('=')[0]} at its default, or use torch.optim.AdamW)"
        )
    for index, group in enumerate(groups if own_update else ()):
        for flag in UNSUPPORTED_FLAGS:
            if group.get(flag):
                raise ValueError(f"fxzero: {option}: fxzero's own Adam update does not implement {flag}=True (param_groups[{index}])")
    dtypes = {p.dtype for p in table.params}
    if (config.param_remainders or config.param_rounding != "auto") and torch.bfloat16 not in dtypes:
        flag = "param_remainders=True" if config.param_remainders else f"param_rounding={config.param_rounding!r}"
        raise ValueError(f"fxzero: Config.{flag} applies to bf16 params, and every managed param is {sorted(map(str, dtypes))}")
    if config.param_remainders and torch.float16 in dtypes:
        slot = next(s for s, p in enumerate(table.params) if p.dtype == torch.float16)
        raise ValueError(f"fxzero: Config.param_remainders=True keeps remainders of bf16 params; param {table.label(slot)!r} is float16")


def _precision_option(config: Config) -> str:
    """The option that asks for fxzero's own update, as the user set it (refusals name it)."""
    for name in ("optimizer_state_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(config, name) not in (None, "fp32"):
            return f"Config.{name}={getattr(config, name)!r}"
    return "Config.param_remainders=True"
