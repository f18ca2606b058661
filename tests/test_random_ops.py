"""Random ops in training (dropout and its kin) under Inductor, at world 1 and 2.

Every random op a model uses in training, in one chain (:class:`Noisy`): ``nn.Dropout``,
``F.dropout``, ``scaled_dot_product_attention(dropout_p=...)``, drop path (``torch.rand``),
``randn_like`` noise (diffusion) and the VAE reparameterisation, ``bernoulli`` and RReLU;
:class:`RandomNet` runs the chain twice, the second time under activation checkpointing.

What torch guarantees, read in Inductor's source (torch 2.13), and what is tested here:

* ``fallback_random=False`` (the default): Inductor's joint-graph pass
  (``fx_passes/replace_random.py``) replaces each random op with its own kernel keyed by a
  seed, and fuses the seeds into one ``inductor_seeds(count)`` per graph and device, which
  at run time is one ``aten.randint`` draw of ``count`` int64 seeds from the device's default
  generator (``ir.RandomSeeds``); op ``i`` in graph order uses seed ``i``, element ``j`` its
  counter ``j``. A graph's masks are thus a function of the generator's state before the
  graph runs and of the random ops' order in the joint graph. fxzero's passes add nodes but
  move no random op, so fxzero and plain ``torch.compile`` of the same Dynamo graph draw
  bitwise the same masks from the same generator state. Under activation checkpointing the
  recompute reads the seeds the forward drew, so it draws the forward's masks; a checkpointed
  chain draws what the same chain without checkpointing draws. (Masks differ from eager's:
  another generator algorithm.)
* ``fallback_random=True``: the random ops run as eager's aten ops in program order, and draw
  eager's masks; under checkpointing AOTAutograd's partitioner saves and replays the generator
  state around each recomputed random op (``functionalize_rng_ops``).
* Ranks: each process draws from its own generator, fxzero draws nothing from it, so ranks
  draw what DDP's ranks draw from the same per-rank seeds. DDP's reference runs with
  ``torch._dynamo.config.optimize_ddp = False``, one graph as fxzero's: DDP's default
  splits the graph at its buckets, and each piece would draw seeds of its own.

Not tested against eager: RReLU under eager (uncompiled) non-reentrant checkpointing returns
gradients hundreds off (torch 2.13; compiled, the same model's checkpointed and
uncheckpointed runs agree), so the eager reference (``fallback_random=True``) runs without
checkpointing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fxzero
from fxzero.testing import run_ranks

LR, STEPS, SEED = 0.1, 3, 1234
EXACT = 1e-6
"""Two runs that draw the same masks agree to float rounding; other masks move the loss by
~1e-2 (the control in :func:`test_random_ops_match_plain_compile_and_recompute_the_same_masks`)."""


class Noisy(nn.Module):
    """Every random op of training in one chain, each with params before it."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(width, width) for _ in range(4))
        self.drop = nn.Dropout(0.3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.drop(self.a(h)), 0.2, self.training)
        q = self.b(h).view(h.shape[0], 2, 2, -1)
        h = h + F.scaled_dot_product_attention(q, q, q, dropout_p=0.25 if self.training else 0.0).reshape(h.shape)
        keep = (torch.rand(h.shape[0], 1, device=h.device) < 0.7).to(h.dtype)  # drop path: whole samples
        h = h + self.c(h) * keep / 0.7
        h = h + 0.1 * torch.randn_like(h)  # diffusion noise
        mu, logvar = self.d(h).chunk(2, dim=-1)
        h = torch.cat([mu + torch.exp(0.5 * logvar) * torch.randn_like(mu), mu], dim=-1)  # VAE
        h = h * torch.bernoulli(torch.full_like(h, 0.8))
        return F.rrelu(h, training=self.training)


class RandomNet(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.inp, self.one, self.two, self.out = nn.Linear(8, 16), Noisy(), Noisy(), nn.Linear(16, 4)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.one(self.inp(x))
        h = checkpoint(self.two, h, use_reentrant=False) if self.checkpointed else self.two(h)
        return self.out(h)


def _batch(device: str) -> torch.Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(5)).to(device)


def train(
    kind: str, *, checkpointed: bool, fallback_random: bool, seed: int = SEED, device: str = "cpu", inner: str = "inductor"
) -> dict[str, Any]:
    """Three SGD steps from the same init and batch: ``kind`` is ``fxzero``, ``plain``
    (``torch.compile``), ``ddp`` (DDP + ``torch.compile``) or ``eager``. The generator is
    seeded just before the first step, after everything is built. ``inner``: fxzero's inner compiler."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = RandomNet(checkpointed).to(device)
    if kind == "fxzero":
        opt: Any = fxzero.DistributedOptimizer(model.parameters(), torch.optim.SGD, lr=LR, module=model)
        forward: Any = torch.compile(model, backend="fxzero", options={"inner_compiler": inner})
    else:
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        wrapped = nn.parallel.DistributedDataParallel(model) if kind == "ddp" else model
        forward = wrapped if kind == "eager" else torch.compile(wrapped)
    x, losses = _batch(device), []
    with torch._inductor.config.patch(fallback_random=fallback_random), torch._dynamo.config.patch(optimize_ddp=False):
        torch.manual_seed(seed)
        for _ in range(STEPS):
            loss = forward(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return {"losses": losses, "params": torch.cat([p.detach().flatten() for p in model.parameters()])}


def diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(max(abs(x - y) for x, y in zip(a["losses"], b["losses"])), (a["params"] - b["params"]).abs().max().item())


def test_the_dropout_of_a_new_users_first_model_compiles() -> None:
    """The repro a new user meets first (``nn.Dropout`` under Inductor, world 1): it trains,
    and draws plain ``torch.compile``'s masks (bitwise the same losses and params)."""

    def run(backend: str) -> list[torch.Tensor]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 8))
        if backend == "fxzero":
            opt: Any = fxzero.DistributedOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-3, module=m)
        else:
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        cm, x = torch.compile(m, backend=backend), torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
        torch.manual_seed(SEED)
        losses = []
        for _ in range(2):
            loss = cm(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses + [p.detach() for p in m.parameters()]

    for ours, plain in zip(run("fxzero"), run("inductor")):
        assert torch.equal(ours, plain)


def test_the_eager_inner_compiler_draws_eagers_masks() -> None:
    """Under ``inner_compiler="eager"`` the random ops run as eager's aten ops: the checkpointed
    chain trains bitwise like eager without checkpointing (eager's own checkpointing is not the
    reference: it gets RReLU's gradient wrong, see above)."""
    ours = train("fxzero", checkpointed=True, fallback_random=False, inner="eager")
    assert diff(ours, train("eager", checkpointed=False, fallback_random=False)) <= EXACT


@pytest.mark.slow
@pytest.mark.parametrize("fallback_random", [False, True], ids=["inductor_random", "fallback_random"])
def test_random_ops_match_plain_compile_and_recompute_the_same_masks(fallback_random: bool) -> None:
    """World 1: fxzero with the second chain checkpointed draws plain ``torch.compile``'s masks
    without checkpointing, forward and recompute alike; with ``fallback_random`` both draw
    eager's, without it others. A run from another seed is the control: it differs by far more
    than the tolerance."""
    ours = train("fxzero", checkpointed=True, fallback_random=fallback_random)
    plain = train("plain", checkpointed=False, fallback_random=fallback_random)
    assert diff(ours, plain) <= EXACT, diff(ours, plain)
    other_seed = train("plain", checkpointed=False, fallback_random=fallback_random, seed=SEED + 1)
    assert diff(other_seed, plain) > 1e3 * EXACT
    eager = train("eager", checkpointed=False, fallback_random=fallback_random)
    if fallback_random:
        assert diff(ours, eager) <= 1e-5, diff(ours, eager)
    else:  # Inductor's own generator: other masks than eager's
        assert diff(ours, eager) > 1e3 * EXACT


def _ranks_train(kind: str, fallback_random: bool) -> dict[str, Any]:
    """Both ranks see the same batch; each seeds its generator with its rank, as a user's
    script that seeds ``base + rank`` does."""
    return train(kind, checkpointed=True, fallback_random=fallback_random, seed=SEED + dist.get_rank())


@pytest.mark.slow
@pytest.mark.parametrize("fallback_random", [False, True], ids=["inductor_random", "fallback_random"])
def test_ranks_draw_the_masks_ddp_ranks_draw(fallback_random: bool) -> None:
    """World 2: each fxzero rank draws what the DDP + ``torch.compile`` rank with its seed
    draws; the ranks' masks differ (the same batch gives each rank another loss) and the
    averaged update is DDP's."""
    ours = run_ranks(2, _ranks_train, "fxzero", fallback_random, timeout=300)
    ddp = run_ranks(2, _ranks_train, "ddp", fallback_random, timeout=300)
    for rank, (a, b) in enumerate(zip(ours, ddp)):
        assert diff(a, b) <= EXACT, (rank, diff(a, b))
    assert abs(ours[0]["losses"][0] - ours[1]["losses"][0]) > 1e3 * EXACT


def test_fxzero_draws_nothing_from_the_generator() -> None:
    """Building the optimizer, its step and ``zero_grad`` leave the default generator where they
    found it: a seeded script's masks are the ones it would draw without fxzero."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    before = torch.get_rng_state()
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1, module=model)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    assert torch.equal(torch.get_rng_state(), before)
