"""The single-process training fxzero is compared with, and its second self.

:class:`Trainer` trains a copy of the model with the user's plain optimizer. Eager, on
the whole global batch, it is *the reference*. On the N rank slices, backpropagating
each and averaging the gradients, it is the *noise floor*: the same training in exact
arithmetic, computed as the ranks compute it (and compiled by plain Inductor when the
ranks use Inductor) but without fxzero, so it rounds as a correct fxzero run would.
How far it drifts from the reference is the yardstick for fxzero's own difference.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn

from .. import mxfp8
from ..model_output import scalar_loss
from .plan import ParityError, call_model, split_batch, trainable_params
from .probe import RankGenerators

__all__ = ["Call", "Trainer", "Trace", "max_abs_diff", "one_thread", "param_snapshot", "run_references"]


def param_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every param by module path (tied params once), copied."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64 (NaN if either holds a NaN; 0 for empty tensors)."""
    if a.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max())


def _mxfp8_round_trip(t: torch.Tensor) -> torch.Tensor:
    """What fxzero's MXFP8 gather makes of a param: its layout starts every param on a
    multiple of 32 elements (a block) and pads with zeros, so the blocks are the flattened param's."""
    flat = t.detach().reshape(-1).float()
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % mxfp8.BLOCK_SIZE))
    return mxfp8.dequantize(*mxfp8.quantize(padded))[: flat.numel()].view(t.shape).to(t.dtype)


class Trainer:
    """A model and the optimizer ``factory`` builds for it, stepped on slices of a batch.

    With ``mxfp8`` the optimizer holds fp32 masters and the model computes on their MXFP8
    round trip after every step, as fxzero's ranks do with ``mxfp8_param_gather``.
    ``compiler``: ``"inductor"`` runs the model through plain ``torch.compile``,
    ``"aot_eager"`` through AOTAutograd without Inductor, ``None`` eagerly. With
    ``generators``, slice ``r`` runs with rank ``r``'s generator (its dropout masks).
    """

    def __init__(self, model: nn.Module, factory: Callable[..., Any], mxfp8_params: bool, compiler: Optional[str] = None,
                 call: "Optional[Call]" = None, generators: Optional[RankGenerators] = None) -> None:  # fmt: skip
        self.model = model
        self.forward = model if compiler is None else torch.compile(model, backend=compiler)
        self.params = trainable_params(model)
        for p in self.params:
            p.grad = None  # a deep copy keeps the user's stale grads
        self.mxfp8 = mxfp8_params
        self.masters = [p.detach().clone().requires_grad_() for p in self.params] if mxfp8_params else self.params
        self.optimizer = factory(list(self.masters))
        self.call = call or Call()
        self.generators = generators

    def step(self, slices: Sequence[tuple[torch.Tensor, ...]], step: int) -> float:
        """One optimizer step on the mean of the slices' gradients; the mean loss."""
        losses = [self._backward(part, step, index) for index, part in enumerate(slices)]
        with torch.no_grad():
            for p, master in zip(self.params, self.masters):
                if p.grad is not None and len(slices) > 1:
                    p.grad.div_(len(slices))
                master.grad = p.grad
            self.optimizer.step()
            for p, master in zip(self.params, self.masters):
                p.grad = master.grad = None
                if self.mxfp8:
                    p.copy_(_mxfp8_round_trip(master))
        return sum(losses) / len(losses)

    def _backward(self, part: tuple[torch.Tensor, ...], step: int, index: int) -> float:
        with self.generators.rank(index) if self.generators is not None else contextlib.nullcontext():
            loss = self.call.loss(self.forward, part, step)
        loss.backward()
        return float(loss.detach())


@dataclasses.dataclass(frozen=True)
class Call:
    """How a batch reaches the model and what of its output is the loss (:mod:`fxzero.model_output`)."""

    keys: tuple[str, ...] = ()
    """A dict batch's keyword names (``()``: positional)."""
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None

    def loss(self, forward: Any, part: tuple[torch.Tensor, ...], step: int) -> torch.Tensor:
        loss, _ = scalar_loss(call_model(forward, part, self.keys), self.loss_fn, f"model(*batch_fn({step}))")
        if not loss.requires_grad:
            raise ParityError(
                f"model(*batch_fn({step})) returned a loss that does not require grad; the forward must compute the "
                "training loss from the params (not under torch.no_grad())"
            )
        return loss


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Compute as each rank does, on one thread: CPU kernels split reductions by thread,
    so the reference's rounding would otherwise depend on this machine's core count
    (and two threads contending with the ranks' processes for the same cores are slow)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclasses.dataclass(frozen=True)
class Trace:
    """The reference's and the noise floor's training, step by step."""

    losses: tuple[float, ...]
    floor_losses: tuple[float, ...]
    params: tuple[dict[str, torch.Tensor], ...]
    """The reference's params after each step."""
    floor_param_diffs: tuple[dict[str, float], ...]
    """max |floor - reference| per param after each step."""


def run_references(
    reference: Trainer, floor: Trainer, batches: Sequence[tuple[torch.Tensor, ...]], parts: int
) -> Trace:
    """The reference steps on the global batch, or, drawing random ops (``generators``), on
    each rank's slice with that rank's generator; the floor on ``parts`` slices."""
    losses, floor_losses, params, floor_diffs = [], [], [], []
    with one_thread():
        for step, batch in enumerate(batches):
            random = reference.generators is not None
            losses.append(reference.step(split_batch(batch, parts, step) if random else [batch], step))
            floor_losses.append(floor.step(split_batch(batch, parts, step), step))
            params.append(param_snapshot(reference.model))
            floor_params = dict(floor.model.named_parameters())
            floor_diffs.append({n: max_abs_diff(floor_params[n].detach(), p) for n, p in params[-1].items()})
    return Trace(tuple(losses), tuple(floor_losses), tuple(params), tuple(floor_diffs))
