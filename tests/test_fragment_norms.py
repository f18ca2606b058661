"""Fragment norms in runs (fxzero/optim/gradients/fragment_norms.py): the plan without tensors, then the
bits against torch._foreach_norm, which step() used per fragment before."""

from __future__ import annotations

import math
import random

import pytest
import torch

import fxzero
from fxzero.optim.gradients.fragment_norms import FragmentNorms, NormRun, plan_norm_runs


def test_a_repeated_block_layout_becomes_one_run_per_fragment_kind() -> None:
    # three blocks of [a:4, b:8, c:4, d:4], 20 elements each: the spacing is the block's
    places = [(0, 20 * block + offset, numel) for block in range(3) for offset, numel in ((0, 4), (4, 8), (12, 4), (16, 4))]
    runs = plan_norm_runs(places)
    assert runs == (
        NormRun(fragments=(0, 4, 8), offset=0, stride=20, numel=4),
        NormRun(fragments=(1, 5, 9), offset=4, stride=20, numel=8),
        NormRun(fragments=(2, 6, 10), offset=12, stride=20, numel=4),
        NormRun(fragments=(3, 7, 11), offset=16, stride=20, numel=4),
    )


def test_runs_never_join_storages_and_leave_irregular_fragments_alone() -> None:
    places = [(0, 0, 4), (0, 10, 4), (0, 20, 4), (0, 25, 4), (0, 30, 4), (1, 40, 4), (0, 5, 2)]
    runs = plan_norm_runs(places)
    assert runs == (
        NormRun(fragments=(0, 1, 2, 4), offset=0, stride=10, numel=4),
        NormRun(fragments=(3,), offset=25, stride=4, numel=4),
        NormRun(fragments=(5,), offset=40, stride=4, numel=4),
        NormRun(fragments=(6,), offset=5, stride=2, numel=2),
    )
    assert sorted(i for run in runs for i in run.fragments) == list(range(len(places)))
    assert plan_norm_runs([]) == ()


def _random_fragments(rng: random.Random) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Views of one flat buffer: blocks of random lengths repeated, plus odd ones, some 2-D."""
    kinds = [rng.choice([1, 3, 8, 17, 64, 127, 1000, 4097, rng.randint(1, 70000)]) for _ in range(rng.randint(1, 5))]
    layout: list[int] = []
    for _ in range(rng.randint(1, 6)):
        layout.extend(kinds)
        layout.append(rng.randint(1, 50))  # something irregular between blocks
    flat = torch.randn(sum(layout) + 64) * rng.choice([1e-3, 1.0, 1e3])
    frags, offset = [], rng.randint(0, 16)
    for numel in layout:
        view = flat[offset : offset + numel]
        frags.append(view.view(numel // 4, 4) if numel % 4 == 0 and rng.random() < 0.3 else view)
        offset += numel
    return flat, frags


@pytest.mark.parametrize("threads", [1, 2])
def test_runs_give_the_bits_of_foreach_norm(threads: int) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = random.Random(threads)
        for _ in range(200):
            _, frags = _random_fragments(rng)
            norms = FragmentNorms(frags)
            got = norms.compute()
            expected = torch.stack(torch._foreach_norm(frags, 2))[list(norms.order)]
            assert torch.equal(got, expected)
            assert sorted(norms.order) == list(range(len(frags)))
    finally:
        torch.set_num_threads(previous)


def test_tensors_off_the_exact_path_keep_foreach_norm() -> None:
    flat = torch.randn(64, dtype=torch.float64)
    frags = [flat[:8], flat[8:16], flat[16:24]]
    norms = FragmentNorms(frags)
    assert norms.order == (0, 1, 2) and norms.calls == 0
    assert torch.equal(norms.compute(), torch.stack(torch._foreach_norm(frags, 2)))
    with_empty = [torch.randn(8), torch.randn(0), torch.randn(0)]  # empty storages may share a null address
    norms = FragmentNorms(with_empty)
    assert norms.order == (0, 1, 2) and norms.calls == 0
    assert torch.equal(norms.compute(), torch.stack(torch._foreach_norm(with_empty, 2)))


def test_an_optimizer_over_repeated_blocks_norms_each_kind_of_fragment_in_one_call() -> None:
    """What the README's code map says: four blocks of six params, at most one call per kind
    of param (here five: the two 512-element weights of all blocks lie evenly spaced), not 24."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)) for _ in range(4)]
    model = torch.nn.Sequential(*blocks)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, module=model)
    norms = opt.runtime.reduced.fragment_norms
    assert 1 <= norms.calls <= 6 and sorted(norms.order) == list(range(24))
    model(torch.randn(8, 16)).square().mean().backward()
    grads = [f.grad for f in opt.runtime.fragments]
    assert torch.equal(norms.compute(), torch.stack(torch._foreach_norm(grads, 2))[list(norms.order)])


def test_step_reports_the_global_norm_of_clip_grad_norm_bit_for_bit() -> None:
    """World size 1: step()'s grad norm (runs, Python squares) against torch's clipping
    computed over the same gradients by hand, in fp64 like fxzero sums them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 16)) for _ in range(4)])
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    model(torch.randn(8, 16)).square().mean().backward()
    squares = [float(torch.linalg.vector_norm(p.grad)) ** 2 for p in model.parameters()]
    result = opt.step()
    assert result.grad_norm == math.sqrt(sum(squares))
