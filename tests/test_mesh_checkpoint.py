"""Checkpoints of DTensor (tensor-parallel) params resume at another data-parallel size and
tensor-parallel degree: saved at dp 2 x tp 2 (world 4), resumed at dp 1 x tp 2 (world 2) and
at dp 4 with no TP (plain params, world 4), each continues like the uninterrupted run.

The model and its TP plan are tests/test_mesh.py's tiny Llama (Colwise/Rowwise attention and
MLP, SequenceParallel RMSNorms, a plain param): its Rowwise weights are ``Shard(1)``, so a
rank's fragment of the local tensor is a strided block of the global param, stored as N-D
chunks at their global offsets (``fxzero/checkpoint/pieces.py``).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from test_mesh import CLIP, LR, Args, TinyLlama, _full, _loss, _tokens, parallelize
from torch.distributed.device_mesh import init_device_mesh

import fxzero
from fxzero.checkpoint import state
from fxzero.checkpoint.pieces import flat_boxes
from fxzero.testing import run_ranks

SAVED_AT, MORE = 2, 2
"""AdamW steps before the save, and after it (in the uninterrupted run and in each resume)."""


def _build(dp: int, tp: int, seed: int) -> tuple[nn.Module, fxzero.DistributedOptimizer, int]:
    """The tiny Llama at dp x tp (tp 1: plain params over the world group), its optimizer and
    this rank's data-parallel index. ``seed`` differs between runs: a resume must not lean on it."""
    torch.manual_seed(seed)
    model, group = TinyLlama(Args()), None
    if tp > 1:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        parallelize(model, mesh["tp"])
        group, dp_rank = mesh["dp"], mesh["dp"].get_local_rank()
    else:
        dp_rank = dist.get_rank()
    config = fxzero.Config(clip_grad=CLIP, bucket_size=4000)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, process_group=group, module=model, config=config)
    return model, opt, dp_rank


def _train(model: nn.Module, opt: fxzero.DistributedOptimizer, dp: int, dp_rank: int, steps: range) -> list[float]:
    """Steps of the global batch (this rank's 1/dp of it); the global mean loss of each."""
    losses = []
    for step in steps:
        loss = _loss(model, _tokens(step).chunk(dp)[dp_rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(loss, group=opt.dp.group)
        losses.append(float(loss) / dp)
    return losses


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: _full(p).detach().clone() for name, p in model.named_parameters()}


def _saved_and_continued(ckpt_dir: str, dp: int, tp: int) -> dict[str, Any]:
    """The uninterrupted run: SAVED_AT steps, a checkpoint, MORE steps."""
    model, opt, dp_rank = _build(dp, tp, seed=0)
    _train(model, opt, dp, dp_rank, range(SAVED_AT))
    path = fxzero.save_checkpoint(ckpt_dir, model, opt, step=SAVED_AT)
    losses = _train(model, opt, dp, dp_rank, range(SAVED_AT, SAVED_AT + MORE))
    return dict(losses=losses, params=_params(model), path=str(path))


def _resumed(ckpt_dir: str, dp: int, tp: int) -> dict[str, Any]:
    """A fresh model (another seed) at dp x tp loads the checkpoint and trains MORE steps."""
    model, opt, dp_rank = _build(dp, tp, seed=1)
    info = fxzero.load_checkpoint(fxzero.latest_checkpoint(ckpt_dir), model, opt)
    losses = _train(model, opt, dp, dp_rank, range(info["step"], info["step"] + MORE))
    return dict(losses=losses, params=_params(model), step=info["step"])


@functools.lru_cache(maxsize=None)
def _saved_at_dp2_tp2(ckpt_dir: str) -> dict[str, Any]:
    """One world-4 save serves every resume (world 4 on 2 cores is slow); rank 0's view."""
    runs = run_ranks(4, _saved_and_continued, ckpt_dir, 2, 2, timeout=120)
    for run in runs[1:]:  # every rank ends with the same full params and losses
        assert run["losses"] == runs[0]["losses"]
        assert all(torch.equal(run["params"][n], p) for n, p in runs[0]["params"].items())
    return runs[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _saved_at_dp2_tp2(str(tmp_path_factory.mktemp("dp2_tp2")))


def _gaps(run: dict[str, Any], reference: dict[str, Any]) -> tuple[float, float]:
    """Largest loss gap, largest param gap."""
    loss = max(abs(a - b) for a, b in zip(run["losses"], reference["losses"]))
    params = max(float((run["params"][n] - p).abs().max()) for n, p in reference["params"].items())
    return loss, params


@pytest.mark.slow
@pytest.mark.parametrize(
    "dp, tp, losses, params", [(1, 2, 1e-5, 1e-6), (4, 1, 1e-5, 1e-6), (2, 2, 0.0, 0.0)], ids=["dp1_tp2", "dp4_tp1", "dp2_tp2"]
)
def test_a_dp2_tp2_checkpoint_resumes_at_another_mesh(saved: dict[str, Any], dp: int, tp: int, losses: float, params: float) -> None:
    """Resumed at dp 1 x tp 2 (world 2) and at dp 4 without TP (world 4), every rank continues
    like the uninterrupted dp 2 x tp 2 run: losses within 1e-5, params within 1e-6 (the
    gradients are averaged over another number of ranks); at dp 2 x tp 2 itself, bitwise."""
    ckpt_dir = str(Path(saved["path"]).parent)
    runs = run_ranks(dp * tp, _resumed, ckpt_dir, dp, tp, timeout=120)
    for rank, run in enumerate(runs):
        assert run["step"] == SAVED_AT
        loss_gap, param_gap = _gaps(run, saved)
        assert loss_gap <= losses and param_gap <= params, (rank, loss_gap, param_gap)


def _old_format_resumes(ckpt_dir: str) -> dict[str, Any]:
    """A checkpoint in fxzero's format before DTensor support (each param's state a 1-D tensor
    of its numel; made here by saving with that placement) loads and resumes."""
    model, opt, _ = _build(1, 1, seed=0)
    _train(model, opt, 1, 0, range(SAVED_AT))
    real = state.placed
    state.placed = lambda p: state.Placed((p.numel(),), (0,), (p.numel(),))
    try:
        path = fxzero.save_checkpoint(ckpt_dir, model, opt, step=SAVED_AT)
    finally:
        state.placed = real
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    shapes = {tuple(entry.size) for key, entry in metadata.items() if key.startswith("optim/") and key.endswith("/main")}
    uninterrupted = dict(losses=_train(model, opt, 1, 0, range(SAVED_AT, SAVED_AT + MORE)), params=_params(model))
    return dict(shapes=shapes, gaps=_gaps(_resumed(ckpt_dir, 1, 1), uninterrupted))


@pytest.mark.slow
def test_a_checkpoint_of_the_older_flat_format_resumes(tmp_path: Path) -> None:
    (result,) = run_ranks(1, _old_format_resumes, str(tmp_path))
    assert all(len(shape) == 1 for shape in result["shapes"]) and (32 * 32,) in result["shapes"], result
    assert result["gaps"] == (0.0, 0.0), result


def test_the_resumed_runs_start_from_other_params() -> None:
    """The resumes build their model from another seed: without the load, params differ by far more than 1e-6."""
    torch.manual_seed(0)
    a = TinyLlama(Args())
    torch.manual_seed(1)
    b = TinyLlama(Args())
    assert max(float((x - y).detach().abs().max()) for x, y in zip(a.parameters(), b.parameters())) > 0.1


@pytest.mark.slow
def test_tp_sharded_state_is_stored_as_global_chunks(saved: dict[str, Any]) -> None:
    """A Rowwise (``Shard(1)``) weight's fp32 masters are a tensor of the global shape, written
    as N-D chunks; tp rank 1's half starts at column 16 (dim // tp)."""
    metadata = dcp.FileSystemReader(saved["path"]).read_metadata()
    entry = metadata.state_dict_metadata["optim/layers.0.attention.wo.weight/main"]
    assert tuple(entry.size) == (32, 32)
    assert {c.offsets[1] for c in entry.chunks} == {0, 16}, entry.chunks
    assert sum(c.sizes.numel() for c in entry.chunks) == 32 * 32
    state = metadata.state_dict_metadata["optim/layers.0.attention.wo.weight/exp_avg"]
    assert tuple(state.size) == (32, 32)


@pytest.mark.parametrize(
    "shape, lo, hi, boxes",
    [
        ((4, 6), 8, 20, [(0, (1, 2), (1, 4)), (4, (2, 0), (1, 6)), (10, (3, 0), (1, 2))]),
        ((4, 6), 6, 18, [(0, (1, 0), (2, 6))]),
        ((2, 3, 4), 5, 7, [(0, (0, 1, 1), (1, 1, 2))]),
        ((5,), 2, 2, []),
    ],
)
def test_flat_boxes(shape: tuple[int, ...], lo: int, hi: int, boxes: list[Any]) -> None:
    """A flat range of a row-major array as boxes that are each contiguous in it."""
    got = flat_boxes(shape, lo, hi)
    assert [(b.start, b.offsets, b.sizes) for b in got] == boxes
    whole = torch.arange(torch.Size(shape).numel()).view(shape)
    for box in got:
        block = whole[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
        assert torch.equal(block.reshape(-1), torch.arange(lo + box.start, lo + box.start + box.numel))


def _mesh_smaller_than_the_world(ckpt_dir: str) -> str:
    """TP over pairs of ranks, and as data-parallel group each rank's own one-rank group: the
    mesh the params live on (1 x 2) is not the world (4), so one DCP call cannot hold them."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    alone = [dist.new_group([rank]) for rank in range(4)][dist.get_rank()]
    torch.manual_seed(0)
    model = TinyLlama(Args())
    parallelize(model, mesh["tp"])
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, process_group=alone, module=model)
    try:
        fxzero.save_checkpoint(ckpt_dir, model, opt, step=0)
    except fxzero.CheckpointError as error:
        return str(error)
    return "saved"


@pytest.mark.slow
def test_a_mesh_that_is_not_the_world_is_refused(tmp_path: Path) -> None:
    for message in run_ranks(4, _mesh_smaller_than_the_world, str(tmp_path), timeout=120):
        assert "data-parallel size 1 x (tp 2) is 2 ranks, the world has 4" in message, message
    assert not list(tmp_path.iterdir())
