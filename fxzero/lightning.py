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
  (``load_state_dict`` of a whole plain state: each rank takes its shard);
* generators: Lightning's checkpoint holds none, so a resumed fit with dropout would draw other
  masks than the uninterrupted run. :meth:`FxzeroStrategy.save_checkpoint` (called on every rank)
  gathers each rank's generator states (:mod:`fxzero.rng`) into the checkpoint under
  ``"fxzero_rng_states"``; ``fit(ckpt_path=...)`` checks them when it loads the checkpoint and
  sets them with the optimizer state, the last of the training state Lightning restores: after
  its set-up (``configure_optimizers`` may draw), before the training loop creates its data
  iterator (which draws its base seed) and the sanity check (which Lightning runs with the
  generators isolated). At the same world size only.

Importing :mod:`fxzero` does not import this module, nor Lightning.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, Optional

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from . import rng
from .distributed_optimizer import DistributedOptimizer, find_distributed_optimizer

__all__ = ["FxzeroStrategy"]

RNG_KEY = "fxzero_rng_states"
"""Where each rank's generator states go in Lightning's checkpoint: ``{"world_size", "states"}``."""

log = logging.getLogger(__name__)


class FxzeroStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` for a model whose gradients a fxzero.DistributedOptimizer
    reduces: the model is not wrapped in DDP. Takes DDPStrategy's arguments (``process_group_backend``,
    ``timeout``, ``start_method``...); DDP's own (``find_unused_parameters``, comm hooks) do not apply."""

    strategy_name = "fxzero"
    _rng_to_restore: Optional[dict[str, Any]] = None

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

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Lightning calls it on every rank and rank 0 writes: each rank's generator states are
        gathered onto rank 0 first, so the checkpoint resumes every rank's dropout masks."""
        states: Optional[list[Any]] = [None] * self.world_size if self.is_global_zero else None
        if self.world_size > 1:
            dist.gather_object(rng.capture(), states, dst=0)
        elif states is not None:
            states[0] = rng.capture()
        super().save_checkpoint({**checkpoint, RNG_KEY: {"world_size": self.world_size, "states": states}}, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Check this rank's saved generator states now, before anything is restored; they are
        set in :meth:`load_optimizer_state_dict`, so nothing Lightning draws while setting up moves them."""
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._rng_to_restore = self._saved_rng_state(checkpoint, checkpoint_path)
        return checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """The last of the training state Lightning restores, after its set-up and before the
        training loop makes its data iterator (which draws): where the generators are set."""
        super().load_optimizer_state_dict(checkpoint)
        if self._rng_to_restore is not None:
            rng.restore(self._rng_to_restore)
            self._rng_to_restore = None

    def _saved_rng_state(self, checkpoint: dict[str, Any], path: Any) -> Optional[dict[str, Any]]:
        saved = checkpoint.get(RNG_KEY)
        if saved is None:
            log.info("checkpoint %s holds no generator states (not saved by FxzeroStrategy): generators not restored", path)
            return None
        if saved["world_size"] != self.world_size:
            if self.is_global_zero:
                log.warning("checkpoint %s: generators not restored: saved at world size %d, resumed at %d (each rank's "
                            "states fit its own rank only)", path, saved["world_size"], self.world_size)  # fmt: skip
            return None
        state = saved["states"][self.global_rank]
        if problems := rng.problems(state):
            raise ValueError(
                f"fxzero.lightning.FxzeroStrategy: checkpoint {path} holds invalid generator states for rank "
                f"{self.global_rank}: {'; '.join(problems)}. Resume from another checkpoint."
            )
        if why := rng.device_mismatch(state):
            log.warning("checkpoint %s: generators not restored: %s", path, why)
            return None
        return state
