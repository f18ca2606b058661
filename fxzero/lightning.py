"""Lightning: ``Trainer(strategy=FxzeroStrategy())`` with a :class:`~fxzero.DistributedOptimizer`.

``strategy="ddp"`` wraps the LightningModule in ``DistributedDataParallel``, which would
all-reduce every gradient fxzero already reduce-scatters, so fxzero refuses to run inside it
(:mod:`fxzero.optim.params.ddp_guard`). :class:`FxzeroStrategy` is Lightning's DDP strategy (its
launcher, process group, distributed samplers, barriers, checkpoint I/O) without the wrapper;
what DDP's wrapper did for the loop, fxzero's optimizer does:

* gradients are averaged over the ranks by the optimizer, built in ``configure_optimizers``
  with ``module=self`` (every trainable param of the LightningModule must be managed by a
  DistributedOptimizer: a param left out would silently train on one rank's data);
* ``accumulate_grad_batches``: Lightning runs all but the last micro-batch of a step inside
  ``strategy.block_backward_sync()``, which under DDP is ``model.no_sync()``; here it is each
  DistributedOptimizer's :meth:`~fxzero.DistributedOptimizer.no_sync`;
* checkpoints (``trainer.save_checkpoint``, ``ModelCheckpoint``): Lightning asks
  ``strategy.optimizer_state(opt)`` on every rank and writes what rank 0 got: Lightning's path
  for sharded optimizers calls :meth:`~fxzero.DistributedOptimizer.consolidate_state_dict` on
  every rank, then ``state_dict()`` on rank 0 only, which returns the whole state, never one
  rank's shard. Resuming loads it on every rank
  (``load_state_dict`` of a whole plain state: each rank takes its shard).

Importing :mod:`fxzero` does not import this module, nor Lightning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lightning.pytorch.strategies import DDPStrategy

from .distributed_optimizer import DistributedOptimizer, find_distributed_optimizer

__all__ = ["FxzeroStrategy"]


class FxzeroStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` for a model whose gradients a fxzero.DistributedOptimizer
    reduces: the model is not wrapped in DDP. Takes DDPStrategy's arguments (``process_group_backend``,
    ``timeout``, ``start_method``...); DDP's own (``find_unused_parameters``, comm hooks) do not apply."""

    strategy_name = "fxzero"

    def configure_ddp(self) -> None:
        """Leave the LightningModule unwrapped: no DDP reducer, no second all-reduce."""

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        self._check_every_param_managed()

    def _fxzero_optimizers(self) -> list[DistributedOptimizer]:
        return [opt for opt in map(find_distributed_optimizer, self.optimizers) if opt is not None]

    def _check_every_param_managed(self) -> None:
        """Without DDP, a trainable param no DistributedOptimizer manages gets no gradient
        averaging: each rank would step it on its own data. Refused, naming it."""
        managed = {id(p) for opt in self._fxzero_optimizers() for p in opt.param_table.params}
        module = self.lightning_module
        assert module is not None
        missing = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in managed]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:4]) + (", …" if len(missing) > 4 else "")
            raise ValueError(
                f"fxzero.lightning.FxzeroStrategy: param(s) {shown} ({len(missing)} in all) of the LightningModule are "
                "not managed by a fxzero.DistributedOptimizer, and this strategy does not wrap the model in DDP, so "
                "nothing would average their gradients over the ranks. Build the optimizer in configure_optimizers as "
                "fxzero.DistributedOptimizer(self.parameters(), torch.optim.AdamW, module=self, ...), or use "
                "strategy='ddp' with a torch.optim optimizer."
            )

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """All but the last micro-batch of an accumulated step (``accumulate_grad_batches``):
        gradients accumulate and no reduction is launched, as in DDP's ``no_sync()``."""
        with contextlib.ExitStack() as stack:
            for opt in self._fxzero_optimizers():
                stack.enter_context(opt.no_sync())
            yield
