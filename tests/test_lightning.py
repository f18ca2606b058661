"""Lightning with fxzero (``fxzero.lightning.FxzeroStrategy``): at world 2, an Inductor-compiled MLP with
nn.Dropout trains bitwise like Lightning's ``strategy="ddp"`` with torch.optim.AdamW, with and without
``accumulate_grad_batches``; ModelCheckpoint saves the whole optimizer state and a resumed fit continues
bitwise, also when only the generators the checkpoint carries give the same dropout masks; ``strategy="ddp"`` and a param left out of the optimizer are refused naming the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """tests/lightning_ranks.py under torchrun at world 2 (one launch for every check below); per rank."""
    tmp = tmp_path_factory.mktemp("lightning")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "tests/lightning_ranks.py", str(tmp / "out"), str(tmp / "ckpt")]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [torch.load(tmp / f"out.{rank}.pt", weights_only=False) for rank in range(2)]


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["losses"] == b["losses"] and a["params"].keys() == b["params"].keys() and all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])


@pytest.mark.job  # Lightning's own launcher, ranks as subprocesses
@pytest.mark.timeout(300)
def test_fxzero_strategy_trains_bitwise_like_ddp_with_adamw_also_accumulating(runs: list[dict[str, Any]]) -> None:
    """2 epochs of 8 steps; then 1 epoch with accumulate_grad_batches=2 (Lightning runs the first
    micro-batch of each step in ``strategy.block_backward_sync()``: the optimizer's ``no_sync()``)."""
    for result in runs:
        assert len(result["fxzero"]["losses"]) == 16 and _same(result["fxzero"], result["reference"])
        assert len(result["fxzero_accumulate"]["losses"]) == 8 and _same(result["fxzero_accumulate"], result["reference_accumulate"])
    assert runs[0]["fxzero"]["losses"] != runs[1]["fxzero"]["losses"]  # each rank its own batches and masks


@pytest.mark.job  # Lightning's own launcher, ranks as subprocesses
@pytest.mark.timeout(300)
def test_model_checkpoint_saves_the_whole_optimizer_state_and_a_resumed_fit_is_bitwise(runs: list[dict[str, Any]]) -> None:
    """ModelCheckpoint after each epoch: the checkpoint holds torch.optim's state_dict schema with every
    param's whole state (not rank 0's shard); ``fit(ckpt_path=<epoch 0>)`` runs epoch 1 with the
    uninterrupted run's losses and ends on its params."""
    assert runs[0]["checkpoints"] == ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt"]
    saved = runs[0]["saved"]["optimizer_states"][0]
    shapes = [tuple(p.shape) for p in runs[0]["fxzero"]["params"].values()]
    assert sorted(saved) == ["param_groups", "state"] and saved["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert [tuple(saved["state"][i]["exp_avg"].shape) for i in range(4)] == shapes
    for result in runs:
        resumed, full = result["resumed"], result["fxzero"]
        assert resumed["losses"] == full["losses"][8:]
        assert all(torch.equal(resumed["params"][n], full["params"][n]) for n in full["params"])


@pytest.mark.job  # Lightning's own launcher, ranks as subprocesses
@pytest.mark.timeout(300)
def test_a_resumed_fit_restores_each_ranks_generators_so_dropout_is_bitwise(runs: list[dict[str, Any]]) -> None:
    """Each rank's generator seeded once, before the fit (no seed per step): ``fit(ckpt_path=<epoch 0>)``
    from other generator states runs epoch 1 with the uninterrupted run's losses (so its dropout
    masks) and ends on its params. Lightning restores no generators itself; FxzeroStrategy carries
    each rank's in the checkpoint and sets them when training starts."""
    for result in runs:
        resumed, full = result["resumed_unseeded"], result["fxzero_unseeded"]
        assert len(full["losses"]) == 16 and resumed["losses"] == full["losses"][8:]
        assert all(torch.equal(resumed["params"][n], full["params"][n]) for n in full["params"])
    assert runs[0]["fxzero_unseeded"]["losses"] != runs[1]["fxzero_unseeded"]["losses"]


@pytest.mark.job  # Lightning's own launcher, ranks as subprocesses
@pytest.mark.timeout(300)
def test_strategy_ddp_and_a_param_left_out_are_refused_naming_the_fix(runs: list[dict[str, Any]]) -> None:
    for result in runs:
        assert "inside torch.nn.parallel.DistributedDataParallel" in result["ddp_strategy"], result["ddp_strategy"]
        assert "Trainer(strategy=fxzero.lightning.FxzeroStrategy())" in result["ddp_strategy"], result["ddp_strategy"]
        assert "'left_out.weight', 'left_out.bias' (2 in all)" in result["left_out"], result["left_out"]
        assert "not managed by a fxzero.DistributedOptimizer" in result["left_out"], result["left_out"]


def test_the_strategy_checks_saved_generator_states_and_keeps_them_to_their_world_size(caplog: pytest.LogCaptureFixture) -> None:
    """World 1, no Trainer: a checkpoint without states (saved by another strategy) restores none,
    saying so in a log line; one saved at another world size restores none and warns naming both;
    a damaged state is refused when the checkpoint is loaded, naming the rank and the fix."""
    import logging

    from fxzero import rng
    from fxzero.lightning import RNG_KEY, FxzeroStrategy

    strategy, state = FxzeroStrategy(), rng.capture()
    with caplog.at_level(logging.INFO, logger="fxzero.lightning"):
        assert strategy._saved_rng_state({}, "a.ckpt") is None
        assert strategy._saved_rng_state({RNG_KEY: {"world_size": 2, "states": [state, state]}}, "b.ckpt") is None
    assert "checkpoint a.ckpt holds no generator states (not saved by FxzeroStrategy): generators not restored" in caplog.text
    assert "checkpoint b.ckpt: generators not restored: saved at world size 2, resumed at 1" in caplog.text
    assert strategy._saved_rng_state({RNG_KEY: {"world_size": 1, "states": [state]}}, "c.ckpt") is state
    if not torch.cuda.is_available():  # CUDA states of a GPU run, resumed on a CPU machine
        assert strategy._saved_rng_state({RNG_KEY: {"world_size": 1, "states": [{**state, "cuda": [torch.zeros(16, dtype=torch.uint8)]}]}}, "e.ckpt") is None
        assert "checkpoint e.ckpt: generators not restored: saved with 1 CUDA device(s), this process sees 0" in caplog.text
    damaged = {**state, "cpu": torch.zeros(3, dtype=torch.uint8)}
    with pytest.raises(ValueError, match=r"checkpoint d\.ckpt holds invalid generator states for rank 0: its cpu generator state is invalid"):
        strategy._saved_rng_state({RNG_KEY: {"world_size": 1, "states": [damaged]}}, "d.ckpt")
