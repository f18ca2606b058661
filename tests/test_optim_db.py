"""Every configuration of torch's own optimizer test table (``optim_db``) through fxzero.

The elementwise classes train bitwise like plain ``torch.optim`` on fragments (world 1 here:
the fragments are whole params cut at bucket boundaries, flattened; world 2 is
``tests/test_optimizer.py``'s business); every other class is refused at construction with
the real cause, not a misleading one (Muon used to fail on the kwargs probe's 1-element
tensor, blaming ``lr``; Adafactor used to train silently wrong on fragments).
"""

from __future__ import annotations

import copy

import pytest
import torch

import fxzero
from fxzero.optim.validation import ELEMENTWISE_OPTIMIZERS

STEPS = 3


def _configs() -> list[tuple[type, dict, str]]:
    from torch.testing._internal.common_optimizers import optim_db

    out = []
    for info in optim_db:
        for i, entry in enumerate(info.optim_inputs_func(device="cpu")):
            out.append((info.optim_cls, entry.kwargs, f"{info.optim_cls.__name__}-{i}-{entry.desc}"))
    return out


_CONFIGS = _configs()


class _Model(torch.nn.Module):
    """2-D weights, 1-D biases and a 3-D param."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
        self.cube = torch.nn.Parameter(torch.randn(2, 3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) + self.cube.sum()


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for step in range(STEPS):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _plain_runs(cls: type, kwargs: dict) -> bool:
    try:
        _train(_Model(), cls(_Model().parameters(), **kwargs))
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


@pytest.mark.parametrize(("cls", "kwargs"), [c[:2] for c in _CONFIGS], ids=[c[2] for c in _CONFIGS])
def test_optim_db_configuration_is_exact_or_refused_with_the_cause(cls: type, kwargs: dict) -> None:
    kwargs = copy.deepcopy(kwargs)
    model = _Model()
    if cls not in ELEMENTWISE_OPTIMIZERS:
        pattern = "LBFGS.step\\(closure\\) needs a closure" if cls is torch.optim.LBFGS else "update each element"
        with pytest.raises(ValueError, match=pattern):
            fxzero.DistributedOptimizer(model.parameters(), cls, config=fxzero.Config(bucket_size=40), **kwargs)
        return
    if not _plain_runs(cls, kwargs):  # e.g. capturable=True needs a GPU: nothing to compare with
        pytest.skip(f"plain {cls.__name__}({kwargs}) does not run on this machine")
    reference = _Model()
    _train(reference, cls(reference.parameters(), **copy.deepcopy(kwargs)))
    opt = fxzero.DistributedOptimizer(model.parameters(), cls, config=fxzero.Config(bucket_size=40), **kwargs)
    _train(model, opt)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), f"{name} differs from plain {cls.__name__}"


def test_an_optimizer_fxzero_does_not_know_runs_once_stated_elementwise() -> None:
    class Sign(torch.optim.SGD):  # a subclass counts as unknown: its step could read shapes
        pass

    with pytest.raises(ValueError, match="Config\\(elementwise_optimizer=True\\)"):
        fxzero.DistributedOptimizer(_Model().parameters(), Sign, lr=0.1)
    model, reference = _Model(), _Model()
    opt = fxzero.DistributedOptimizer(model.parameters(), Sign, lr=0.1, config=fxzero.Config(elementwise_optimizer=True))
    _train(model, opt)
    _train(reference, torch.optim.SGD(reference.parameters(), lr=0.1))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
