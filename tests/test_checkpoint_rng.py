"""Each rank's generators in ``fxzero.save_checkpoint`` / ``load_checkpoint``: a resume with
dropout on continues bitwise the uninterrupted run (Hugging Face GPT-2 with its default
dropout, world 2, Inductor and the eager inner compiler); the states are per rank, listed and
verified like the other files, restored only at the rank layout they were saved with, and a
damaged one is refused with nothing changed."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import torchvision_compat

torchvision_compat.ensure_torchvision_importable()  # rank processes import this module without conftest

import numpy as np
import pytest
import torch
import torch.distributed as dist

import fxzero
from fxzero.testing import run_ranks
from test_checkpoint import _assert_same, _make, _snapshot, _train

SAVED_AT, MORE = 2, 2  # steps before the save, and after it
GLOBAL, SEQ = 4, 16


# ---- world 2: Hugging Face GPT-2 with its default dropout ------------------------------
def _gpt2(seed: int) -> torch.nn.Module:
    """Hugging Face GPT-2 shrunk in depth and width only: its dropouts (embedding, attention,
    residual: 0.1) are on, as the config ships."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=32, vocab_size=64, bos_token_id=0, eos_token_id=0)
    assert (config.resid_pdrop, config.embd_pdrop, config.attn_pdrop) == (0.1, 0.1, 0.1)
    return transformers.GPT2LMHeadModel(config).train()


def _setup(inner: str, seed: int) -> tuple[torch.nn.Module, Any, fxzero.DistributedOptimizer]:
    model = _gpt2(seed)
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, module=model)
    options = {} if inner == "inductor" else {"inner_compiler": inner}
    return model, torch.compile(model, backend="fxzero", options=options), opt


def _steps(compiled: Any, opt: fxzero.DistributedOptimizer, steps: range) -> list[torch.Tensor]:
    """This rank's losses; batches are functions of the step, each rank takes its half."""
    rank, losses = dist.get_rank(), []
    for step in steps:
        tokens = torch.randint(0, 64, (GLOBAL, SEQ), generator=torch.Generator().manual_seed(step))
        mine = tokens.chunk(dist.get_world_size())[rank]
        loss = compiled(input_ids=mine, labels=mine).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _uninterrupted_then_resumed(inner: str, ckpt_dir: str) -> tuple[dict[str, Any], dict[bool, dict[str, Any]]]:
    """Both runs in one task: the fresh model's compile reuses the first one's graphs (Dynamo's
    guards hold; fxzero's graphs find their optimizer through the params), which halves the time."""
    return _uninterrupted(inner, ckpt_dir), _resumed(inner, ckpt_dir)


def _uninterrupted(inner: str, ckpt_dir: str) -> dict[str, Any]:
    """SAVED_AT steps, a save, MORE steps; each rank seeds its generator apart (its own masks)."""
    model, compiled, opt = _setup(inner, seed=0)
    torch.manual_seed(100 + dist.get_rank())
    losses = _steps(compiled, opt, range(SAVED_AT))
    fxzero.save_checkpoint(ckpt_dir, model, opt, step=SAVED_AT)
    losses += _steps(compiled, opt, range(SAVED_AT, SAVED_AT + MORE))
    opt.finish_param_sync()
    return {"losses": losses, "params": _params(model)}


def _resumed(inner: str, ckpt_dir: str) -> dict[str, Any]:
    """A fresh model from another seed resumes from the checkpoint, first with ``rng=False``
    (the control: other masks), then as a user would."""
    model, compiled, opt = _setup(inner, seed=1)
    path = fxzero.latest_checkpoint(ckpt_dir)
    runs = {}
    for rng in (False, True):
        torch.manual_seed(7)  # the generators as a fresh process leaves them: the load must set them
        info = fxzero.load_checkpoint(path, model, opt, rng=rng)
        losses = _steps(compiled, opt, range(SAVED_AT, SAVED_AT + MORE))
        opt.finish_param_sync()
        runs[rng] = {"losses": losses, "params": _params(model), "rng": info["rng"]}
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("inner", ["inductor", "eager"])
def test_a_resume_with_dropout_continues_the_uninterrupted_run_bitwise(tmp_path: Path, inner: str, caplog: Any) -> None:
    """World 2: the resumed run's losses and params are bitwise the uninterrupted run's (under
    Inductor the masks come from seeds drawn from the restored generator); without the
    generators (``rng=False``) the masks, and so the losses, differ. Loaded at world 1 (another
    layout), the generators are left alone, and rank 0 warns once naming both world sizes."""
    straight, resumed = zip(*run_ranks(2, _uninterrupted_then_resumed, inner, str(tmp_path), timeout=300))
    for rank, (full, runs) in enumerate(zip(straight, resumed)):
        again = runs[True]
        assert all(map(torch.equal, again["losses"], full["losses"][SAVED_AT:])), (rank, again["losses"], full["losses"])
        assert all(torch.equal(again["params"][n], full["params"][n]) for n in full["params"]), rank
        assert again["rng"] == "restored"
        assert runs[False]["rng"] == "not restored: load_checkpoint(..., rng=False)"
        assert not torch.equal(runs[False]["losses"][0], full["losses"][SAVED_AT])
    assert not torch.equal(straight[0]["losses"][0], straight[1]["losses"][0])  # each rank its own data and masks
    path = fxzero.latest_checkpoint(tmp_path)
    assert sorted(json.loads((path / "fxzero.json").read_text())["rng"]["files"]) == ["rng_state_0.pt", "rng_state_1.pt"]
    if inner == "eager":  # one layout change is enough
        _load_at_world_one(path, caplog)


def _load_at_world_one(path: Path, caplog: Any) -> None:
    model, opt = _gpt2(seed=3), None
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, module=model)
    before = torch.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="fxzero.checkpoint.generators"):
        info = fxzero.load_checkpoint(path, model, opt)
    want = "not restored: saved at world size 2 (data-parallel size 2), loaded at world size 1 (data-parallel size 1)"
    assert info["rng"] == want and torch.equal(torch.get_rng_state(), before)
    assert [r.getMessage() for r in caplog.records if want in r.getMessage()] == [
        f"checkpoint {path}: the generators were {want} (each rank's states fit its own rank only; "
        "dropout masks after the resume differ from the uninterrupted run's)"
    ]


# ---- world 1: what is saved, opting out, old and damaged checkpoints ---------------------
def _draws() -> list[float]:
    """One draw from each generator a checkpoint restores."""
    return [random.random(), float(np.random.rand()), float(torch.rand(()))]


def test_every_generator_is_saved_per_rank_listed_and_restored(tmp_path: Path) -> None:
    """Python's ``random``, NumPy's and torch's CPU generator: after a load they draw what they
    drew after the save; the file is in the manifest's list with its size and SHA-256."""
    model, opt = _make("mlp", 2000)
    _train("mlp", model, opt, range(1))
    path = fxzero.save_checkpoint(tmp_path, model, opt, step=1)
    after_save = _draws()
    manifest = json.loads((path / "fxzero.json").read_text())
    assert manifest["rng"] == {"world_size": 1, "data_parallel_size": 1, "instances": 1, "files": ["rng_state_0.pt"]}
    assert manifest["files"]["rng_state_0.pt"]["bytes"] == (path / "rng_state_0.pt").stat().st_size
    assert set(torch.load(path / "rng_state_0.pt", weights_only=True)) == {"python", "numpy", "cpu"}  # no CUDA here
    _draws()
    assert fxzero.load_checkpoint(path, *_make("mlp", 2000, seed=1))["rng"] == "restored"
    assert _draws() == after_save


def test_rng_false_saves_or_restores_no_generators(tmp_path: Path, caplog: Any) -> None:
    """``save_checkpoint(rng=False)`` writes no states (the load says so in a log line, as for a
    checkpoint of fxzero 0.2.0, which has none); ``load_checkpoint(rng=False)`` leaves the generators alone."""
    model, opt = _make("mlp", 2000)
    with_rng = fxzero.save_checkpoint(tmp_path, model, opt, step=1)
    without = fxzero.save_checkpoint(tmp_path, model, opt, step=2, rng=False)
    assert not list(without.glob("rng_state_*")) and json.loads((without / "fxzero.json").read_text())["rng"] is None
    before = torch.get_rng_state()
    with caplog.at_level(logging.INFO, logger="fxzero.checkpoint.generators"):
        info = fxzero.load_checkpoint(without, model, opt)
    none = "not restored: the checkpoint holds no generator states (saved with rng=False, or by fxzero 0.2.0 or older)"
    assert info["rng"] == none and f"checkpoint {without}: the generators were {none}" in caplog.text
    assert fxzero.load_checkpoint(with_rng, model, opt, rng=False)["rng"] == "not restored: load_checkpoint(..., rng=False)"
    assert torch.equal(torch.get_rng_state(), before)


def test_a_checkpoint_of_fxzero_0_2_without_generator_states_loads(tmp_path: Path) -> None:
    model, opt = _make("mlp", 2000)
    path = fxzero.save_checkpoint(tmp_path, model, opt, step=1)
    manifest = json.loads((path / "fxzero.json").read_text())
    del manifest["rng"], manifest["files"]["rng_state_0.pt"]  # what fxzero 0.2.0 wrote
    (path / "rng_state_0.pt").unlink()
    (path / "fxzero.json").write_text(json.dumps(manifest))
    assert fxzero.load_checkpoint(path, *_make("mlp", 2000, seed=1))["rng"].startswith("not restored: the checkpoint holds no generator states")


def _rewrite(path: Path, name: str, data: bytes, *, listed: bool = True) -> None:
    """Replace a file and its manifest entry (a damage the hashes cannot see), or unlist it."""
    (path / name).write_bytes(data)
    manifest = json.loads((path / "fxzero.json").read_text())
    manifest["files"].pop(name)
    if listed:
        from fxzero.checkpoint.manifest import sha256

        manifest["files"][name] = {"bytes": len(data), "sha256": sha256(path / name)}
    (path / "fxzero.json").write_text(json.dumps(manifest))


def _saved_state(**replace: Any) -> bytes:
    import io

    from fxzero import rng

    buffer = io.BytesIO()
    torch.save({**rng.capture(), **replace}, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        ("flip", r"rng_state_0\.pt does not match its SHA-256 in the manifest \(corrupted\)"),
        ("unlisted", r"rng_state_0\.pt \(generator states\) is not in fxzero\.json's file list"),
        ("not_a_state", r"rng_state_0\.pt \(generator states\) cannot be read"),
        ("short_cpu_state", r"rng_state_0\.pt \(generator states of rank 0\): its cpu generator state is invalid"),
        ("bad_python_state", r"rng_state_0\.pt \(generator states of rank 0\): its python generator state is invalid"),
    ],
)
def test_a_damaged_generator_file_is_refused_naming_it_with_nothing_restored(tmp_path: Path, damage: str, match: str) -> None:
    model, opt = _make("mlp", 2000)
    _train("mlp", model, opt, range(1))
    path = fxzero.save_checkpoint(tmp_path, model, opt, step=1)
    name = "rng_state_0.pt"
    if damage == "flip":
        raw = bytearray((path / name).read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        (path / name).write_bytes(bytes(raw))
    elif damage == "unlisted":
        _rewrite(path, name, (path / name).read_bytes(), listed=False)
    elif damage == "not_a_state":
        _rewrite(path, name, b"not a torch.save file")
    elif damage == "short_cpu_state":
        _rewrite(path, name, _saved_state(cpu=torch.zeros(10, dtype=torch.uint8)))
    else:
        _rewrite(path, name, _saved_state(python=(3, (1, 2), None)))
    model2, opt2 = _make("mlp", 2000, seed=5)
    before, generator = _snapshot(model2, opt2), torch.get_rng_state()
    with pytest.raises(fxzero.CheckpointError, match=match):
        fxzero.load_checkpoint(path, model2, opt2)
    _assert_same(before, _snapshot(model2, opt2))
    assert torch.equal(torch.get_rng_state(), generator)


def test_changed_layout_restores_nothing(tmp_path: Path) -> None:
    """The layout is the world size, the data-parallel size and the number of instances."""
    from fxzero.checkpoint.generators import layout, read_states

    model, opt = _make("mlp", 2000)
    path = fxzero.save_checkpoint(tmp_path, model, opt, step=1)
    manifest = json.loads((path / "fxzero.json").read_text())
    assert layout(opt.dp) == {"world_size": 1, "data_parallel_size": 1, "instances": 1}
    manifest["rng"]["instances"] = 2
    state, why = read_states(path, manifest, opt.dp, True)
    assert state is None
    assert why == "not restored: saved at world size 1 (data-parallel size 1 in 2 instances), loaded at world size 1 (data-parallel size 1)"


@pytest.mark.cuda
def test_each_cuda_devices_generator_is_saved_and_restored(tmp_path: Path) -> None:
    """Where CUDA is initialized, every device's generator is saved with the others and restored:
    dropout on the GPU draws after the load what it drew after the save."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)).cuda()
    opt = fxzero.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, module=model)
    x = torch.ones(4, 8, device="cuda")
    path = fxzero.save_checkpoint(tmp_path, model, opt, step=0)
    after_save = model(x).detach()
    assert len(torch.load(path / "rng_state_0.pt", weights_only=True)["cuda"]) == torch.cuda.device_count()
    model(x)
    assert fxzero.load_checkpoint(path, model, opt)["rng"] == "restored"
    assert torch.equal(model(x).detach(), after_save)


def test_cuda_states_for_another_number_of_devices_restore_nothing(tmp_path: Path) -> None:
    """A rank saved with CUDA states, loaded where another number of devices is visible (here none)."""
    model, opt = _make("mlp", 2000)
    path = fxzero.save_checkpoint(tmp_path, model, opt, step=1)
    _rewrite(path, "rng_state_0.pt", _saved_state(cuda=[torch.zeros(16, dtype=torch.uint8)]))
    before = torch.get_rng_state()
    info = fxzero.load_checkpoint(path, model, opt)
    assert info["rng"] == f"not restored: saved with 1 CUDA device(s), this process sees {torch.cuda.device_count()}"
    assert torch.cuda.is_available() or torch.equal(torch.get_rng_state(), before)
