"""Refuse a model whose params fxzero manages when it runs inside ``DistributedDataParallel``.

HF Trainer and Accelerate wrap the model in DDP under torchrun, and so does Lightning's
``strategy="ddp"``. DDP would then all-reduce
every gradient that fxzero already reduce-scatters (three times the gradient traffic, a
second full-size gradient buffer, and ``find_unused_parameters`` graph walks), and under
``torch.compile`` Dynamo splits the graphs fxzero's backend plans at DDP's bucket bounds.
The numbers can still come out right, which is why this is an error rather than a warning:
nothing else would show it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..._torch_compat import active_ddp_module

__all__ = ["refuse_ddp", "refuse_ddp_module"]


def refuse_ddp(module: torch.nn.Module, args: Any) -> None:
    """Forward pre-hook on the module given as ``module=``: raise inside a DDP forward."""
    wrapper = active_ddp_module()
    if wrapper is not None and any(sub is module for sub in wrapper.module.modules()):
        raise RuntimeError(_inside_ddp("the model is running inside torch.nn.parallel.DistributedDataParallel"))


def refuse_ddp_module(module: Any) -> None:
    """``module=DDP(model)``, the most literal port of a DDP loop, refused at construction: DDP's
    reducer holds the params' old storage, which the optimizer's flat buffers replace, so its
    first backward would fail deep in autograd with an error that never names DDP."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        raise RuntimeError(
            _inside_ddp("module= is a torch.nn.parallel.DistributedDataParallel wrapper")
            + " Pass the model itself (module=model, not module=DDP(model)) and train the model unwrapped, or "
            "compiled with torch.compile(model, backend='fxzero')."
        )


def _inside_ddp(where: str) -> str:
    return (
        "fxzero: this model's params are managed by a fxzero.DistributedOptimizer, which reduces their "
        f"gradients itself, and {where}: DDP would all-reduce them again. Do not wrap it in DDP. With "
        "Accelerate, prepare the optimizer and "
        "data loaders but not the model (accelerator.prepare(opt, dl)) and register the model for save_state "
        "(accelerator.register_for_checkpointing(model)); with HF Trainer, set "
        "model._is_accelerate_prepared = True before Trainer(...) (docs/integrations.md). "
        "With Lightning, use Trainer(strategy=fxzero.lightning.FxzeroStrategy()) instead of strategy='ddp', the "
        "DistributedOptimizer built in configure_optimizers with module=self (docs/integrations.md)."
    )
