"""Which params would hold a ``.grad`` tensor under torch.optim: what ``zero_grad(set_to_none=False)`` zeroes.

torch.optim's ``zero_grad(set_to_none=False)`` zeroes the gradients params hold and leaves ``None``
where there is none: a param that got no gradient since the last ``zero_grad()`` setting them to
``None`` (the default) keeps none, and the next step passes it by. fxzero's ``step()`` consumes the
gradients, so it keeps that record itself: a param holds a gradient from its first one, on any rank
(DDP's all-reduce leaves the average on every rank), until ``opt.zero_grad()`` sets them to ``None``.
A Python int is the set (one byte-wide flag per param): adding a step's flags is one C-level pass, and
nothing at all once every param holds one.
"""

from __future__ import annotations

from typing import Iterable, Sequence

__all__ = ["HeldGrads"]


class HeldGrads:
    """The params holding a gradient tensor in torch.optim's terms, over steps."""

    def __init__(self, num_params: int) -> None:
        self._num_params = num_params
        self._all = int.from_bytes(b"\x01" * num_params, "little")
        self._held = 0

    def add(self, got: Iterable[float]) -> None:
        """Params whose ``got[slot]`` is not zero got a gradient this step (a count of ranks, or a flag)."""
        if self._held != self._all:
            self._held |= int.from_bytes(bytes(map(bool, got)), "little")

    def release(self) -> None:
        """``zero_grad()`` with ``set_to_none=True``: no param holds a gradient."""
        self._held = 0

    def flags(self) -> bytes:
        """One byte per param, 1 where it holds a gradient."""
        return self._held.to_bytes(self._num_params, "little")

    def carry(self, earlier: "HeldGrads", earlier_params: Sequence[object], params: Sequence[object]) -> None:
        """Take ``earlier``'s record, kept over ``earlier_params``, onto this one's ``params`` (``add_param_group``
        lays the params out anew): a param keeps holding its gradient, one new to the optimizer holds none.
        Without it the new table would forget them, and ``zero_grad(set_to_none=False)`` would zero no
        gradient, so the next step would pass those params by where torch.optim steps them on zeros."""
        holding = {id(p) for p, flag in zip(earlier_params, earlier.flags()) if flag}
        self.release()
        self.add([id(p) in holding for p in params])
