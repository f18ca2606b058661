"""What a parity check learns from the model before it trains it, in a few eager forwards.

Why before: a model the check cannot compare (one that mixes samples across the batch,
or a loss summed over it) used to be found after minutes of training, from the step-1
losses, and its dropout was taken for such mixing. Two questions settle it in seconds,
on a copy of the model, without gradients:

* **random ops**: does the loss on the same slice change with the generator's seed?
  (dropout, ``F.dropout``, SDPA's ``dropout_p``, ``randn_like`` noise; found by what the
  model does, not by module type.) Such a model is compared exactly all the same: the
  reference runs each rank's slice with that rank's generator (:class:`RankGenerators`).
* **batch mixing**: is the loss on the global batch the mean of its slices' losses, with
  the random ops off (eval mode, only when there are random ops: eval mode may change
  more than dropout)? If not, no reference on slices or on the batch can match a run
  where each rank sees only its slice, and the message says what to change.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn

from ..model_output import scalar_loss
from .plan import call_model, split_batch

__all__ = ["RANK_SEED", "RankGenerators", "batch_mixing", "has_random_ops"]

RANK_SEED = 20261128
"""Rank ``r`` seeds its default generator with ``RANK_SEED + r`` before training, as a training
script that seeds ``base + rank`` does; the reference draws from the same states."""

MIXING = 1e-4
"""Relative |global-batch loss - mean of the slices' losses| above which the model mixes samples
(fp32 rounding is ~1e-7)."""


class RankGenerators:
    """Each rank's default-generator state, for a reference in one process: inside
    ``rank(r)`` random ops draw what rank ``r``'s process draws after seeding ``RANK_SEED + r``."""

    def __init__(self, world: int) -> None:
        with torch.random.fork_rng(devices=[]):
            self.states = []
            for rank in range(world):
                torch.manual_seed(RANK_SEED + rank)
                self.states.append(torch.get_rng_state())

    @contextlib.contextmanager
    def rank(self, rank: int) -> Iterator[None]:
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.states[rank])
            yield
            self.states[rank] = torch.get_rng_state()


def _loss(model: nn.Module, batch: tuple[torch.Tensor, ...], keys: Sequence[str], loss_fn: Optional[Callable[..., Any]]) -> float:
    return float(scalar_loss(call_model(model, batch, keys), loss_fn, "fxzero.parity")[0])


def has_random_ops(model: nn.Module, batch: tuple[torch.Tensor, ...], keys: Sequence[str], loss_fn: Any) -> bool:
    """Whether the loss on ``batch`` depends on the generator (two seeds, a copy of the model)."""
    twin = copy.deepcopy(model)
    losses = []
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for seed in (1, 2):
            torch.manual_seed(seed)
            losses.append(_loss(twin, batch, keys, loss_fn))
    return losses[0] != losses[1]


def batch_mixing(
    model: nn.Module, batch: tuple[torch.Tensor, ...], parts: int, keys: Sequence[str], loss_fn: Any, random: bool
) -> tuple[str, ...]:
    """Why the global batch's loss is not the mean of its ``parts`` slices' losses (empty: it is)."""
    if parts < 2:
        return ()
    twin = copy.deepcopy(model)
    if random:
        twin.eval()  # the random ops off: their masks differ between a batch and its slices
    with torch.no_grad():
        whole = _loss(twin, batch, keys, loss_fn)
        slices = sum(_loss(twin, part, keys, loss_fn) for part in split_batch(batch, parts, 0)) / parts
    if abs(whole - slices) <= MIXING * max(abs(whole), abs(slices)):
        return ()
    mode = " (random ops off: eval mode)" if random else ""
    return (
        f"before training{mode}, the loss on the global batch {whole:.6g} != mean of its {parts} slices' losses "
        f"{slices:.6g}: each rank sees only its slice, so no reference can match. Fix: make the loss a mean over "
        "the batch (reduction='mean', not 'sum'); a model that mixes samples across the batch (BatchNorm in train "
        "mode, in-batch negatives) cannot be checked as it is: check it with that part replaced (GroupNorm or "
        "LayerNorm for BatchNorm, or the BatchNorm in eval mode)",
    )
