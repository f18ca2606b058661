"""One comparison of a sharded run with its reference, per step and per param (as torch's
``check_sharded_parity`` in its distributed test utilities): every param of the reference must
be in the run, and a mismatch names the step or the param that differs. Tolerances of 0 compare
bitwise; the expected values always come from the reference run, never from fxzero itself."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

__all__ = ["assert_parity"]


def assert_parity(
    actual: Mapping[str, Any], expected: Mapping[str, Any], *, loss_atol: float = 0.0, param_atol: float = 0.0, rtol: float = 0.0
) -> None:
    """``actual`` and ``expected``: a run's ``{"losses": [per step], "params": {name: tensor}}``
    (either key may be absent on both sides; ``actual`` may hold more, a module's buffers). Losses
    within ``loss_atol``, every param of ``expected`` within ``param_atol``."""
    assert actual.keys() & {"losses", "params"} == expected.keys() & {"losses", "params"}, (actual.keys(), expected.keys())
    if "losses" in expected:
        _same_steps(actual["losses"], expected["losses"], loss_atol, rtol)
    if "params" in expected:
        missing = sorted(set(expected["params"]) - set(actual["params"]))
        assert not missing, f"params of the reference missing from the run: {missing}"
        for name, value in expected["params"].items():
            torch.testing.assert_close(actual["params"][name], value, atol=param_atol, rtol=rtol, msg=lambda m, n=name: f"param {n}: {m}")


def _same_steps(actual: Sequence[float], expected: Sequence[float], atol: float, rtol: float) -> None:
    assert len(actual) == len(expected), f"{len(actual)} steps, the reference ran {len(expected)}"
    for step, (got, want) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(float(got), float(want), atol=atol, rtol=rtol, msg=lambda m, s=step: f"loss of step {s}: {m}")
