"""Hugging Face Trainer checkpoints with a :class:`~fxzero.DistributedOptimizer`.

Trainer saves the optimizer with ``torch.save(optimizer.state_dict(), ...)`` on rank 0 alone
(``Trainer._save_optimizer_and_scheduler``), and at world size > 1 fxzero's ``state_dict()``
is collective: every rank holds a shard of the state. :class:`CheckpointCallback` makes every
rank gather the whole state onto rank 0 (:meth:`~fxzero.DistributedOptimizer.consolidate_state_dict`)
at the step Trainer is about to save, the protocol of ZeroRedundancyOptimizer that Lightning
follows too; rank 0's ``state_dict()`` then returns it. Trainer's ``optimizer.pt`` holds the
whole state in torch.optim's schema, and ``resume_from_checkpoint`` loads it on every rank
(``load_state_dict`` is collective, and Trainer calls it on every rank).

Without the callback, rank 0's ``state_dict()`` fails after ``Config.state_dict_timeout``
seconds, naming it: never a checkpoint holding rank 0's shard only.

Importing this module imports ``transformers``; ``import fxzero`` does not.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .distributed_optimizer import find_distributed_optimizer

__all__ = ["CheckpointCallback", "find_distributed_optimizer"]  # the latter re-exported for recipes

log = logging.getLogger(__name__)


class CheckpointCallback(TrainerCallback):
    """Gather the optimizer's whole state onto rank 0 right before each checkpoint Trainer saves.

    ``Trainer(..., optimizers=(opt, None), callbacks=[fxzero.hugging_face.CheckpointCallback()])``.
    Trainer decides to save in its flow callback, which runs before this one at the end of
    each step and epoch (``control.should_save``); ``save_strategy="best"`` decides after each
    evaluation, so there the state is gathered after every evaluation."""

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if control.should_save:
            self._consolidate(args, kwargs.get("optimizer"))

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if control.should_save:
            self._consolidate(args, kwargs.get("optimizer"))

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if str(getattr(args.save_strategy, "value", args.save_strategy)) == "best":
            self._consolidate(args, kwargs.get("optimizer"))

    @staticmethod
    def _consolidate(args: TrainingArguments, optimizer: Any) -> None:
        if args.save_only_model:
            return  # Trainer saves no optimizer state then
        opt = find_distributed_optimizer(optimizer)
        if opt is None:
            raise TypeError(
                "fxzero.hugging_face.CheckpointCallback: Trainer's optimizer is "
                f"{type(optimizer).__name__}, not a fxzero.DistributedOptimizer; pass one as Trainer(optimizers=(opt, None))"
            )
        with torch.no_grad():  # save_on_each_node: each node's first rank saves
            opt.consolidate_state_dict(to=None if args.save_on_each_node else 0)
        log.debug("optimizer state gathered onto rank 0 for Trainer's checkpoint")
