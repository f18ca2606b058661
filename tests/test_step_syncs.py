"""``step()`` reads tensor values into Python once: on a GPU each such read is a host sync.

On CPU a test double counts them: a torch function mode sees every read of a tensor's
value into Python (``item``, ``tolist``, ``bool``/``float``/``int``, ``torch.equal``, ...).
Tensors torch.optim keeps on the host by design (its ``step`` counters, CPU tensors even
on a GPU) are not counted. ``tests/test_cuda.py`` checks the same with CUDA's own sync
debug mode where a GPU is. The flat update (:mod:`fxzero.optim.update.flat_update`) applies on the
CPU only, so these runs take the path a GPU takes, fragment by fragment (:func:`_as_on_a_gpu`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator
from unittest import mock

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import fxzero
from fxzero.testing import run_ranks

from models import batch, build, loss_fn, param_groups

_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "equal", "is_nonzero", "cpu", "numpy", "nonzero", "masked_select"}


class ValueReads(TorchFunctionMode):
    """Names of the value reads made inside the block, except of tensors ``host()`` names
    (by id; asked at each read: torch.optim makes its step counters during the first step)."""

    def __init__(self, host: Callable[[], set[int]]) -> None:
        super().__init__()
        self.host, self.reads = host, []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _READS and not (args and isinstance(args[0], torch.Tensor) and id(args[0]) in self.host()):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _as_on_a_gpu() -> Iterator[None]:
    """The optimizer built inside steps fragment by fragment, as on a GPU (on the CPU its flat
    update compares step counts once, when it homes the state, and its twin reads its own step
    counters: host reads, never syncs)."""
    with mock.patch("fxzero.optim.update.flat_update.flat_update_applies", return_value=False):
        yield


def _reads_per_step(config: fxzero.Config, compiled: bool) -> list[list[str]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("gpt")
    with _as_on_a_gpu():
        opt = fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=1e-2, config=config, module=model)
    assert opt.runtime.update.twin is None
    run = torch.compile(model, backend="fxzero", options={"inner_compiler": "eager"}) if compiled else model
    steps = []
    for step in range(3):
        x, y = batch("gpt", step, 4 * world)
        loss_fn("gpt", run(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4]).backward()
        with ValueReads(lambda: {id(s["step"]) for s in opt.runtime.local.state.values() if "step" in s}) as reads:
            opt.step()
        steps.append(reads.reads)
    return steps


def test_step_reads_the_device_once() -> None:
    """The one read: the all-reduced per-param presence flags and squared norms (the global
    norm, clipping and "did any rank get a gradient")."""
    for compiled in (False, True):
        for steps in run_ranks(2, _reads_per_step, fxzero.Config(clip_grad=1.0), compiled):
            assert steps == [["tolist"]] * 3, (compiled, steps)


def test_the_counter_sees_reads() -> None:
    """The double counts what a GPU would sync on, and not the host-resident step counters."""
    t, host = torch.ones(3), torch.ones(())
    with ValueReads(lambda: {id(host)}) as reads:
        t.sum().item(), t.tolist(), bool(t[0]), float(t[0]), torch.equal(t, t), host.item()
    assert reads.reads == ["item", "tolist", "__bool__", "__float__", "equal"]


def _reads_with_scaler() -> list[list[str]]:
    rank = dist.get_rank()
    model = build("gpt")
    with _as_on_a_gpu():
        opt = fxzero.DistributedOptimizer(param_groups(model), torch.optim.AdamW, lr=1e-2, module=model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    steps = []
    for step in range(2):
        x, y = batch("gpt", step, 8)
        scaler.scale(loss_fn("gpt", model(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4])).backward()
        with ValueReads(lambda: {id(s["step"]) for s in opt.runtime.local.state.values() if "step" in s}) as reads:
            opt.grad_scale, opt.found_inf = scaler._scale, torch.zeros(())  # what GradScaler.step hands over
            opt.step()
        del opt.grad_scale, opt.found_inf
        steps.append(reads.reads)
    return steps


def test_what_adds_reads_to_step() -> None:
    """Documented costs beyond the one read: GradScaler's scale and inf flag; with the MXFP8
    gather (or bf16/fp16 params) one torch.equal per bucket, checking for values written
    outside the optimizer."""
    for steps in run_ranks(2, _reads_with_scaler):
        assert steps == [["tolist", "__float__", "__float__"]] * 2, steps
    config = fxzero.Config(bucket_size=2000, mxfp8_param_gather=True)
    for steps in run_ranks(2, _reads_per_step, config, False):
        assert steps[0].count("equal") >= 2 and steps == [["equal"] * steps[0].count("equal") + ["tolist"]] * 3, steps
