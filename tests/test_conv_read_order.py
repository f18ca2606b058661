"""Conv models under Inductor: every read of a param, Inductor's own copies included,
comes after its bucket's gather wait, and the wait gets the params themselves.

Inductor's layout optimization (on for any graph with a 2-D conv on CPU with oneDNN, and by
a flop heuristic on GPU) converts conv weights to channels-last. Before the fix it made
that copy when it lowered the graph input, ahead of every node, and handed the copy to
the wait too (the wait failed to find its optimizer; at world > 1 the copy held last
step's values). Each case below trains two steps and runs one no-grad forward at world
1 under Inductor, with one bucket per param (a wait per bucket, spread through the graph),
and checks the generated forward and inference code (:mod:`generated_code`) and the
numbers against plain eager AdamW.
"""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

import fxzero

from generated_code import check_waits

LR = 1e-2


def _head(features: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(features, 4))


class SqueezeExcite(nn.Module):
    """EfficientNet's block: a depthwise conv, then channel gates from two 1x1 convs on the
    pooled features (the zoo's EfficientNet runs under the eager inner compiler; this is its
    Inductor case)."""

    def __init__(self) -> None:
        super().__init__()
        self.expand, self.depthwise = nn.Conv2d(3, 8, 1), nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.reduce, self.gate, self.head = nn.Conv2d(8, 2, 1), nn.Conv2d(2, 8, 1), _head(8 * 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.depthwise(self.expand(x)))
        return self.head(x * torch.sigmoid(self.gate(F.silu(self.reduce(x.mean((2, 3), keepdim=True))))))


class PatchEmbed(nn.Module):
    """A ViT's patch embedding: a strided conv, tokens, LayerNorm, a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.norm, self.fc = nn.Conv2d(3, 16, 4, stride=4), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(self.proj(x).flatten(2).transpose(1, 2)).mean(1))


_CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], bool]] = {
    # name: (model, input shape, input channels_last)
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(3, 8, 3), nn.ReLU(), _head(8 * 14)), (4, 3, 16), False),
    "conv2d": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), _head(8 * 16)), (4, 3, 8, 8), False),
    "conv3d": (lambda: nn.Sequential(nn.Conv3d(3, 4, 3), nn.ReLU(), _head(4 * 64)), (2, 3, 6, 6, 6), False),
    "depthwise": (lambda: nn.Sequential(nn.Conv2d(3, 8, 1), nn.Conv2d(8, 8, 3, groups=8), _head(8 * 36)), (4, 3, 8, 8), False),
    "squeeze_excite": (SqueezeExcite, (4, 3, 8, 8), False),
    "grouped": (lambda: nn.Sequential(nn.Conv2d(3, 8, 1), nn.Conv2d(8, 8, 3, groups=2), _head(8 * 36)), (4, 3, 8, 8), False),
    "conv_transpose": (lambda: nn.Sequential(nn.ConvTranspose2d(3, 4, 3, stride=2), nn.ReLU(), _head(4 * 81)), (2, 3, 4, 4), False),
    # no conv bias before a BatchNorm (as real nets): its true gradient is exactly 0 in training, so
    # the computed one is rounding noise that Adam scales up to lr-sized steps in any two implementations
    "conv_bn_train": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), _head(8 * 36)), (4, 3, 8, 8), False),
    "conv_bn_eval": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), _head(8 * 36)).eval(), (4, 3, 8, 8), False),
    "vit_patch_embed": (PatchEmbed, (2, 3, 16, 16), False),
    "channels_last_input": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), _head(8 * 16)), (4, 3, 8, 8), True),
}


def _data(shape: tuple[int, ...], channels_last: bool, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(shape, generator=g)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    return x, torch.randn(shape[0], 4, generator=g)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_CASES))
def test_conv_params_are_read_only_after_their_wait(name: str) -> None:
    make, shape, channels_last = _CASES[name]
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    config = fxzero.Config(bucket_size=1, overlap_param_gather=True)  # one bucket per param: the waits spread through the graph
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, config=config, module=model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    cmodel = torch.compile(model, backend="fxzero")  # Inductor
    codes: list[str] = []
    for step in range(2):
        x, y = _data(shape, channels_last, step)
        loss, code = run_and_get_code(lambda: torch.nn.functional.mse_loss(cmodel(x), y))
        codes += code if step == 0 else []
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with torch.no_grad():
        x, _ = _data(shape, channels_last, 2)
        out, code = run_and_get_code(lambda: cmodel(x))
        torch.testing.assert_close(out, reference(x), atol=1e-4, rtol=0)
    codes += code
    params = len(list(model.parameters()))
    assert len(opt.runtime.buckets) == params
    forwards = [c for c in codes if "wait_params" in c]
    assert len(forwards) == 2, "a training forward and an inference graph"
    for generated in forwards:
        check = check_waits(generated)
        assert check.not_inputs == (), f"a wait was handed a copy: {check.not_inputs}"
        assert check.early == (), "\n".join(check.early)
        assert len(check.waited) == params, "every param is covered by a wait"
    for (key, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=0, msg=key)


@pytest.mark.slow
def test_inductor_freezing_never_folds_params_into_fxzero_graphs() -> None:
    """With ``freezing`` on, ``torch.compile``'s own Inductor backend folds params into
    constants of inference graphs (conv + BatchNorm folded into one weight): an optimizer
    step would then never reach them. fxzero's graphs keep params as inputs."""
    make, shape, channels_last = _CASES["conv_bn_eval"]
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, module=model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    x, y = _data(shape, channels_last, 0)
    with torch._inductor.config.patch(freezing=True):
        cmodel = torch.compile(model, backend="fxzero")
        with torch.no_grad():
            before = cmodel(x)  # an inference graph, compiled under freezing
        for m, o in ((cmodel, opt), (reference, ref_opt)):
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
        with torch.no_grad():
            after = cmodel(x)
    assert not torch.equal(before, after), "the step changed the params: the inference graph must see it"
    torch.testing.assert_close(after, reference(x).detach(), atol=1e-5, rtol=0)
