"""HF Trainer and Accelerate with fxzero (README "Hugging Face Trainer and Accelerate"): the
recipe in examples/hf_trainer.py trains exactly like Trainer + AdamW under DDP; a move of the
model to the device it is on keeps the optimizer's views; a fxzero model inside DDP is refused."""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxzero
from fxzero.testing import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _model_and_opt() -> tuple[torch.nn.Module, fxzero.DistributedOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    return model, fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1, module=model)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    for step in range(2):
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(step))).sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_moving_the_model_to_the_device_it_is_on_keeps_training_exact() -> None:
    model, opt = _model_and_opt()
    model.to("cpu:0")  # what Trainer and Accelerate do on CPU: torch copies every CPU tensor
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    got, want = _train(model, opt), _train(ref, torch.optim.AdamW(ref.parameters(), lr=0.1))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    storages = {b.param_data.untyped_storage().data_ptr() for b in opt.buffers}  # the params are still the buffers' views
    assert all(p.untyped_storage().data_ptr() in storages for p in opt.param_table.params)


def test_model_no_sync_is_the_optimizers_and_a_copy_or_pickle_gets_an_inert_one() -> None:
    """What Accelerate's ``accumulate`` and Trainer's accumulation enter: ``model.no_sync()``."""
    model, opt = _model_and_opt()
    with model.no_sync():
        assert opt.runtime.ledger.accumulating
    assert not opt.runtime.ledger.accumulating
    buffer = io.BytesIO()
    torch.save(model, buffer)
    for copied in (copy.deepcopy(model), torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)):
        with copied.no_sync():
            assert not opt.runtime.ledger.accumulating


def test_param_data_replaced_by_new_values_trains_on_as_with_torch_optim() -> None:
    """Trainer's resume loads the checkpoint's weights into the params it moved (copies):
    ``param.data = t`` of the same dtype, device and shape is taken in, as torch.optim would."""
    model, opt = _model_and_opt()
    model.to("cpu:0")
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    for net in (model, ref):
        net[0].weight.data = net[0].weight.data + 1
    got, want = _train(model, opt), _train(ref, torch.optim.AdamW(ref.parameters(), lr=0.1))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_real_cast_is_still_refused_and_new_values_with_no_gather_in_flight_are_taken_in() -> None:
    """Under overlapped gathers a copy is refused only where a gather could have landed after it
    was taken (tests/test_refusals.py, world 2); at world 1 no gather ever runs, so ``p.data = t``
    is taken in as torch.optim would train on it."""
    model, opt = _model_and_opt()
    model[0].double()
    with pytest.raises(RuntimeError, match=r"param '0.weight' \(now torch.float64 on cpu\) is no longer a view"):
        opt.step()
    params = []
    for kind in ("fxzero", "torch"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        opt = (fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1, module=model,
                                           config=fxzero.Config(overlap_param_gather=True))  # fmt: skip
               if kind == "fxzero" else torch.optim.AdamW(model.parameters(), lr=0.1))
        model[0].weight.data = model[0].weight.data + 1
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*params))


def _forward_inside_ddp() -> str:
    model, _ = _model_and_opt()
    try:
        torch.nn.parallel.DistributedDataParallel(model)(torch.ones(1, 4))
    except RuntimeError as error:
        return str(error)
    return "ran"


@pytest.mark.timeout(120)
def test_a_fxzero_model_inside_ddp_is_refused_naming_the_fix() -> None:
    for message in run_ranks(2, _forward_inside_ddp, timeout=90):
        assert "inside torch.nn.parallel.DistributedDataParallel" in message
        assert "accelerator.prepare(opt, dl)" in message and "model._is_accelerate_prepared = True" in message
        assert "Trainer(strategy=fxzero.lightning.FxzeroStrategy())" in message


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """tests/hf_trainer_ranks.py under torchrun at world 2 (one launch for every check below)."""
    root = tmp_path_factory.mktemp("hf")
    out = root / "results.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "tests/hf_trainer_ranks.py", str(out), str(root)]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return torch.load(out, weights_only=False)


def _same(a: tuple[list[float], list[torch.Tensor]], b: tuple[list[float], list[torch.Tensor]]) -> bool:
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.mark.job  # one torchrun job at world 2 for them all (about 40 s)
@pytest.mark.timeout(480)
def test_the_trainer_recipe_with_accumulation_trains_exactly_like_trainer_with_adamw_under_ddp(recipe: dict) -> None:
    fxzero_run, reference = recipe["trainer_fxzero"]["straight"], recipe["trainer_reference"]["straight"]
    assert len(fxzero_run[0]) == 4 and _same(fxzero_run, reference)


@pytest.mark.job  # one torchrun job at world 2 for them all (about 40 s)
@pytest.mark.timeout(480)
def test_trainer_checkpoints_hold_the_whole_optimizer_state_and_resume_exactly(recipe: dict) -> None:
    """Trainer's optimizer.pt (saved by rank 0 alone) is the whole state in torch.optim's schema,
    the same as DDP + AdamW's; resuming from it trains on bitwise, as the reference does."""
    fxzero_run, reference = recipe["trainer_fxzero"], recipe["trainer_reference"]
    saved, want = (torch.load(r["optimizer_file"], weights_only=True) for r in (fxzero_run, reference))
    assert sorted(saved["state"]) == sorted(want["state"]) == list(range(len(fxzero_run["straight"][1])))
    for index, state in want["state"].items():
        assert sorted(saved["state"][index]) == sorted(state)
        assert all(torch.equal(saved["state"][index][key], value) for key, value in state.items())
    assert _same(reference["resumed"], reference["straight"])
    assert _same(fxzero_run["resumed"], fxzero_run["straight"]) and _same(fxzero_run["resumed"], reference["resumed"])


@pytest.mark.job  # one torchrun job at world 2 for them all (about 40 s)
@pytest.mark.timeout(480)
def test_trainer_given_an_optimizer_built_before_it_moved_the_model_saves_and_resumes_exactly(recipe: dict) -> None:
    """``optimizers=(opt, None)``: Trainer's move copies the params and its resume loads the
    checkpoint's weights into the copies; both are taken in (they were refused, naming the param)."""
    reference = recipe["trainer_reference"]
    assert _same(recipe["trainer_object"], reference["straight"]) and _same(recipe["trainer_object_resumed"], reference["resumed"])


@pytest.mark.job  # one torchrun job at world 2 for them all (about 40 s)
@pytest.mark.timeout(480)
def test_accelerate_accumulate_save_state_and_load_state_train_like_ddp(recipe: dict) -> None:
    """Two micro-batches a step (``accelerator.accumulate``), ``save_state`` after the first
    step, a fresh model, optimizer and accelerator ``load_state`` and take the second: bitwise
    what the same loop does under DDP."""
    assert len(recipe["accelerate_fxzero"][0]) == 4 and _same(recipe["accelerate_fxzero"], recipe["accelerate_reference"])


@pytest.mark.job  # one torchrun job at world 2 for them all (about 40 s)
@pytest.mark.timeout(480)
def test_accelerate_wrapping_the_model_in_ddp_is_refused_naming_the_fix(recipe: dict) -> None:
    assert "model._is_accelerate_prepared = True" in recipe["accelerate_prepared_model"]


def test_torch_compile_backend_fxzero_is_refused_by_accelerate_and_trainers_default_is_fused_adamw(tmp_path: Path) -> None:
    from accelerate.utils import TorchDynamoPlugin
    from transformers import TrainingArguments

    with pytest.raises(ValueError, match="'FXZERO' is not a valid DynamoBackend"):
        TorchDynamoPlugin(backend="fxzero")  # what TrainingArguments(torch_compile_backend="fxzero") builds
    assert TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none").optim == "adamw_torch_fused"
