"""One Inductor-generated pass per run for fxzero's own Adam update (``Config.compiled_update``).

The eager update (:mod:`~fxzero.optim.update.shard_adam`) is a chain of torch ops per run, each a
pass over memory with its own temporaries: decoding a narrow moment, updating it and encoding it
again read and write the run's bytes a dozen times. Here the same update is one function of the
run's stored tensors (codes and scales, the fp32 master, the gradient), compiled by Inductor with
dynamic shapes, so one generated kernel serves every run of a mode and the run's bytes are read and
written about once.

* **8-bit runs step as block rows** (rows of one block) where the run is whole blocks (the usual case): the
  master, the gradient and the codes come in as ``(blocks, 32)`` views, the 32 a constant in the
  graph. Inductor then makes two passes over the run, one taking each block's maxima and one
  writing the master and the codes; over the flat run it made three, and wrote each new moment to
  an fp32 temporary and read it back (fp8 moments, 5.24M elements, one thread, paired: 13.1 ms
  against 27.4 ms over the flat run, ``benchmarks/update_limits.py``; the same bits,
  ``tests/test_precision.py``).
* **Remainders stay out of this loop**: a run with remainders is joined into the step's fp32 scratch
  before and split after (:mod:`~fxzero.optim.params.rounding_kernels`, loops on two elements per
  word). Inside this loop the int16 remainder made Inductor write scalar code for all of it: with
  the join and split outside, bf16 moments with remainders stepped 5.24M elements in 9.9 ms instead
  of 24.7 ms, fp8 moments in 25.2 ms instead of 52.7 ms (one thread, the same bits).
* **Why not for every mode**: Inductor's arithmetic is not torch.optim's to the last bit. Eager
  ``torch.sqrt`` on the CPU is not correctly rounded (it differed from the correctly rounded root,
  which Inductor's loop computes, on 17% of random fp32 inputs on this project's machine), eager
  ``lerp_`` and ``addcmul_`` use fused multiply-adds that Inductor's loops (compiled with
  ``-ffp-contract=off``) do not, and here ``sqrt(v)`` is multiplied by the inverse of the bias
  correction instead of divided (one division per element, not two). So modes with a bitwise
  promise (fp32 state with remainders: bitwise the half-away fp32-master run) keep the eager Adam
  arithmetic, with their bit operations compiled (:mod:`~fxzero.optim.params.rounding_kernels`);
  this serves runs with at least one narrow moment.
* **No recompiles per step**: the hyperparameters and bias corrections come in one fp32 tensor (each taken in
  Python's double first, ``1 - beta2`` included, as torch.optim takes them), and
  the shapes are dynamic, so a new step, a new lr or another run of the same kinds reuses the graph.
  One graph per kinds of moments and flags (the guards on the inputs' dtypes pick it).
* **The compile cost is paid once per process** (and Inductor's FX graph cache makes a later
  process's compile warm); :attr:`FusedRunUpdate.compiles` counts them and
  :attr:`FusedRunUpdate.compile_seconds` times them.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from ..._torch_compat import mark_static
from ...inductor_function import Compiling, shared
from .moment_store import BLOCK, HIGH_HALF, BlockStore, MomentStore, PairHalf, PlainStore, RootStore, nearest_bf16_bits

__all__ = ["FusedRunUpdate"]


def _parts(store: MomentStore) -> tuple[torch.Tensor, ...]:
    if isinstance(store, PairHalf):
        return (store.words,) if store.high else ()  # the first moment's parts carry the word of both
    if isinstance(store, PlainStore):
        return (store.values,)
    return (store.codes, store.scales)  # type: ignore[union-attr]


def _span_parts(store: MomentStore, start: int, stop: int) -> Optional[tuple[torch.Tensor, ...]]:
    """``store``'s parts for elements ``start:stop`` of its run; ``None`` where that cuts an 8-bit
    block (its scale would be taken over elements the stretch does not update)."""
    parts = _parts(store)
    if isinstance(store, (PairHalf, PlainStore)):
        return tuple(t[start:stop] for t in parts)
    if start % BLOCK or (stop % BLOCK and stop != store.numel):  # type: ignore[union-attr]
        return None
    codes, scales = parts
    return codes[start : start + -(-(stop - start) // BLOCK) * BLOCK], scales[start // BLOCK : -(-stop // BLOCK)]


def _decode(kind: str, parts: Sequence[torch.Tensor], n: int) -> torch.Tensor:
    """The moment's fp32 values: in rows of blocks where the run comes in rows (:func:`_in_rows`)."""
    if kind == "plain":
        return parts[0].float()
    decode = BlockStore.decode if kind == "block" else RootStore.decode
    blocks = decode(parts[0].view(-1, BLOCK), parts[1])
    return blocks if parts[0].dim() == 2 else blocks.reshape(-1)[:n]


def _encode(kind: str, values: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    if kind == "plain":
        parts[0].copy_(values)
        return
    blocks = values if values.dim() == 2 else F.pad(values, (0, parts[0].numel() - values.numel())).view(-1, BLOCK)
    encode = BlockStore.encode if kind == "block" else RootStore.encode
    encode(blocks, parts[0].view(-1, BLOCK), parts[1])


def _in_rows(kinds: tuple[str, str], grad: torch.Tensor) -> bool:
    """Whether the run steps as rows of one block each: it has 8-bit blocks (``pair`` has none) and
    whole blocks only. Why rows: Inductor then writes the master, the codes and the per-block
    maxima from loops over the same rows, one pass to take the maxima and one to write; over the
    flat run it also wrote each new moment to an fp32 temporary and read it back to encode it."""
    return ("block" in kinds or "root" in kinds) and grad.numel() % BLOCK == 0 and grad.numel() > 0


def _rows(parts: Sequence[torch.Tensor], n: int) -> tuple[torch.Tensor, ...]:
    """``parts``' tensors of ``n`` elements as rows of one block (a constant length in the graph);
    the per-block ones as they are."""
    return tuple(mark_static(t.view(-1, BLOCK), 1) if t.numel() == n else t for t in parts)


def _one_per_block(kinds: tuple[str, str], m_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """1.0 for each row, made from a per-block tensor. Multiplied into the master's update (exact:
    ``x * 1.0`` is ``x``, NaN and signed zero included), it keeps that update in the loop that
    writes the codes: Inductor flattens a pointwise loop that reads nothing per block, and such a
    loop runs on its own, after the step is stored to an fp32 temporary to be read back there."""
    scales = m_parts[1] if kinds[0] != "plain" else v_parts[1]
    return (scales.to(torch.int32) * 0 + 1).to(torch.float32).unsqueeze(1)


def _kind(store: MomentStore) -> str:
    if isinstance(store, PairHalf):
        return "pair"
    return "plain" if isinstance(store, PlainStore) else "block" if isinstance(store, BlockStore) else "root"


def _moments(kinds: tuple[str, str], m_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kinds[0] == "pair":
        words = m_parts[0]
        return (words & HIGH_HALF).view(torch.float32), (words << 16).view(torch.float32)
    return _decode(kinds[0], m_parts, n), _decode(kinds[1], v_parts, n)


def _keep_moments(kinds: tuple[str, str], m: torch.Tensor, v: torch.Tensor, m_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor]) -> None:
    if kinds[0] == "pair":
        m_parts[0].copy_(nearest_bf16_bits(m) | ((nearest_bf16_bits(v) >> 16) & 0xFFFF))
        return
    _encode(kinds[0], m, m_parts)
    _encode(kinds[1], v, v_parts)


def _adam_run(master: torch.Tensor, grad: torch.Tensor, m_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor],
              scalars: torch.Tensor, kinds: tuple[str, str], flags: tuple[bool, bool, bool]) -> None:  # fmt: skip
    """The update of :func:`~fxzero.optim.update.shard_adam._adam` on one run's fp32 ``master`` (written in
    place), its stores read and written here."""
    decoupled, maximize, decay = flags
    one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay_factor, step_size, inverse_bias_correction2_sqrt = scalars.unbind()
    n = grad.numel()
    g = -grad.float() if maximize else grad.float()
    new = master
    if decay and decoupled:
        new = new * decay_factor
    elif decay:
        g = g + weight_decay * new
    m, v = _moments(kinds, m_parts, v_parts, n)
    m = m.lerp(g, one_minus_beta1)
    v = v * beta2 + one_minus_beta2 * g * g
    new = new - step_size * m / (v.sqrt() * inverse_bias_correction2_sqrt + eps)  # one division per element, not two
    _keep_moments(kinds, m, v, m_parts, v_parts)
    master.copy_(new * _one_per_block(kinds, m_parts, v_parts) if grad.dim() == 2 else new)


_KINDS_LIMIT = 64
"""Graphs of :func:`_adam_run` at most: 3 x 3 kinds of moments x remainders x 3 flags, and shape guards."""


class FusedRunUpdate:
    """The compiled run update of one :class:`~fxzero.optim.update.shard_adam.ShardAdamW`."""

    def __init__(self, compiling: Compiling) -> None:
        self._compiling = compiling
        self._scalars: Optional[torch.Tensor] = None
        self._key: Any = None
        """What :attr:`_scalars` was made from: the hyperparameters, the step count and the device."""

    @property
    def compiling(self) -> Compiling:
        """Whether this optimizer's update runs compiled (``Config.compiled_update``; false after a failed compile under ``None``)."""
        return self._compiling

    @property
    def compiles(self) -> int:
        """Graphs of the run update compiled in this process so far (by every optimizer's)."""
        return shared(_adam_run, _KINDS_LIMIT).compiles

    @property
    def compile_seconds(self) -> float:
        """Seconds those compiles took."""
        return shared(_adam_run, _KINDS_LIMIT).compile_seconds

    @staticmethod
    def takes(exp_avg: MomentStore, exp_avg_sq: MomentStore, start: int, stop: int) -> bool:
        """Whether elements ``start:stop`` of a run can step alone (a stretch of a run some of whose
        fragments have no gradient): not where they cut an 8-bit block."""
        return _span_parts(exp_avg, start, stop) is not None and _span_parts(exp_avg_sq, start, stop) is not None

    def __call__(self, master: torch.Tensor, grad: torch.Tensor, exp_avg: MomentStore, exp_avg_sq: MomentStore, step: int,
                 hyper: tuple, span: Optional[tuple[int, int]] = None) -> bool:  # fmt: skip
        """Step the run's fp32 ``master`` (its params, or the scratch its remainders were joined into);
        with ``span``, only elements ``span[0]:span[1]`` of the run (``master`` and ``grad`` are theirs:
        see :meth:`takes`). ``False``: nothing was written, the compile is not available (see
        :class:`~fxzero.inductor_function.Compiling`) and the caller steps the run eagerly."""
        if not self._compiling.active:
            return False
        lr, beta1, beta2, eps, weight_decay, maximize, decoupled = hyper
        key = (hyper, step, master.device)  # everything the scalars are made of: the runs of a step share them
        if key != self._key or self._scalars is None:
            # the differences with 1 in Python's double, as torch.optim takes them: in fp32 from an fp32 beta2 near 1,
            # 1 - beta2 is off by up to 2^-25 (1.4e-3 of it at 0.99999), and so is every second moment
            values = (1 - beta1, beta2, 1 - beta2, eps, weight_decay, 1 - lr * weight_decay, lr / (1 - beta1**step), 1 / (1 - beta2**step) ** 0.5)
            self._scalars = torch.tensor(values, dtype=torch.float32, device=master.device)
            self._key = key
        flags = (bool(decoupled), bool(maximize), weight_decay != 0)
        kinds = (_kind(exp_avg), _kind(exp_avg_sq))
        if span is None:
            m_parts, v_parts = _parts(exp_avg), _parts(exp_avg_sq)
        else:
            m_parts, v_parts = _span_parts(exp_avg, *span), _span_parts(exp_avg_sq, *span)  # type: ignore[assignment]
        if _in_rows(kinds, grad):
            n = grad.numel()
            (master, grad), m_parts, v_parts = _rows((master, grad), n), _rows(m_parts, n), _rows(v_parts, n)
        return self._compiling.call(_adam_run, _KINDS_LIMIT, master, grad, m_parts, v_parts, self._scalars, kinds, flags)[0]
