"""The model zoo (:mod:`zoo`: timm and Hugging Face models nobody here wrote, plus the
adapters and Python-routed experts of ``models.py``) trained by fxzero at world 2 under
Inductor (ResNet and the adapters; the others under the eager inner compiler:
``zoo.Case.inner`` says where their Inductor cases are) with
the param all-gathers overlapping the forward (the mode with more to get wrong):

* parity against single-process eager SGD with momentum on the same data, each rank's half run
  separately and the per-rank losses averaged (DDP's semantics: BatchNorm statistics and
  expert routing per rank): loss within 1e-5 and params within 1e-4, or within twice the
  noise floor of that model where the floor is larger (plain ``torch.compile`` with
  Inductor against the same eager reference). SGD, not Adam: Adam turns Inductor's rounding
  on gradients that are nearly zero into whole lr-sized steps (a floor as large as the
  params' whole movement for the BatchNorm models here), which would hide the errors
  these tests look for (a gradient in another param's slot, a param read before its
  gather: both move params by lr x gradient);
* overlap on (gathers whose data lands only when waited for, so a read before its wait
  sees last step's values) and overlap off give bitwise the same losses and params.

Every model runs its default regularisation (T5's dropout 0.1; the timm models, Mixtral and
Whisper ship none), each rank drawing its own masks (:func:`models.seed_rank`); the reference
draws each rank's masks for that rank's half (:class:`models.RankGenerators`). The eager
inner compiler draws eager's masks; no Inductor case of the zoo has a random op (Inductor
draws other masks than eager: ``test_random_ops.py``, and ``test_hf_models.py``'s GPT-2,
whose reference is plain ``torch.compile``).

Images are 64x64 so that the BatchNorm models' last layers normalise over more than a
handful of values (at 32x32 a 1e-7 difference in summation order grew to 1e-4 in three
steps, in eager code too). ``FXZERO_ZOO_TABLE=1`` prints a row per model (and always
measures the noise floor): ``pytest tests/test_zoo.py -s``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import fxzero
from fxzero.optim.communication.comm import DataParallelGroup
from fxzero.testing import run_ranks

from doubles import deferred_all_gather
from models import batch as model_batch
from models import build as build_model
from models import loss_fn as model_loss
from models import RankGenerators, rank_step, runs_from_initial_state, seed_rank
from zoo import ZOO, Case

LR, STEPS, GLOBAL, WORLD = 0.05, 3, 8, 2


def _optimizer() -> dict[str, Any]:
    """SGD's settings, for fxzero and the references alike."""
    return dict(lr=LR, momentum=0.9, weight_decay=1e-4)
_TABLE = os.environ.get("FXZERO_ZOO_TABLE") == "1"


def _routed_case() -> Case:
    """``models.AdapterNet`` with the adapter picked by rank and step (experts routed in Python)."""
    return Case(
        lambda: build_model("adapters"),
        lambda step, size: dict(zip(("x", "y"), model_batch("adapters", step, size)), step=torch.tensor(step)),
        lambda model, b: model_loss("adapters", model(b["x"], (int(b["step"]) + int(b["rank"])) % 4), b["y"]),
    )


_CASES: dict[str, Case] = {**ZOO, "routed_experts": _routed_case()}


def _half(b: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s part of the global batch (a half at world 2)."""
    local = GLOBAL // world
    part = {k: (v[rank * local : (rank + 1) * local] if v.dim() else v) for k, v in b.items()}
    return part | {"rank": torch.tensor(rank)}


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]  # Whisper's sinusoidal positions are frozen


def _build(case: Case) -> torch.nn.Module:
    torch.manual_seed(0)
    return case.build()


def _train(case: Case, model: torch.nn.Module, cmodel: Any, *, overlap: bool) -> dict[str, Any]:
    """One fxzero run on this rank of the compiled ``cmodel``; ``overlap`` runs with deferred gathers."""
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    config = fxzero.Config(bucket_size=numel // 4, overlap_param_gather=overlap)
    opt = fxzero.DistributedOptimizer(_trainable(model), torch.optim.SGD, config=config, module=model, **_optimizer())
    gather = deferred_all_gather if overlap else DataParallelGroup.all_gather_async
    losses = []
    seed_rank(rank)  # the rank's own dropout masks, the same in both runs
    with mock.patch.object(DataParallelGroup, "all_gather_async", gather):
        for step in range(STEPS):
            losses.append(rank_step(case.loss(cmodel, _half(case.data(step, GLOBAL), rank, world)), opt))
        opt.finish_param_sync()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "buckets": len(opt.runtime.buckets), "numel": numel}


def _train_both(name: str) -> dict[str, Any]:
    """Overlap on, then off, through the same compiled graphs: the two runs execute the same
    generated code and differ only in when each gather's data lands, so any difference is a
    read before its wait (:func:`models.runs_from_initial_state`)."""
    start = time.perf_counter()
    case = _CASES[name]
    model = _build(case)
    cmodel = torch.compile(model, backend="fxzero", dynamic=False, options={"inner_compiler": case.inner})
    on, off = runs_from_initial_state(model, (True, False), lambda overlap: _train(case, model, cmodel, overlap=overlap))
    return {"on": on, "off": off, "wall": time.perf_counter() - start}


def _reference(name: str, *, compiled: bool, world: int = WORLD) -> dict[str, Any]:
    """Single process, each rank's half run separately with that rank's generator (its
    dropout masks), per-rank losses averaged. ``compiled``: plain ``torch.compile`` with
    ``fallback_random`` (eager's masks: the floor is Inductor's rounding alone)."""
    case = _CASES[name]
    model = _build(case)
    opt = torch.optim.SGD(_trainable(model), **_optimizer())
    forward = torch.compile(model) if compiled else model
    generators, losses = RankGenerators(world), []
    for step in range(STEPS):
        b = case.data(step, GLOBAL)
        with torch._inductor.config.patch(fallback_random=True):
            loss = generators.mean_loss(lambda r: case.loss(forward, _half(b, r, world)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}, "moved": _moved(case, model)}


def _moved(case: Case, model: torch.nn.Module) -> float:
    """How far training moved the params from their initial values (max abs)."""
    initial = dict(_build(case).named_parameters())
    return max((p.detach() - initial[n]).abs().max().item() for n, p in model.named_parameters())


def _diffs(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float]:
    loss = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
    params = max((a["params"][k] - v).abs().max().item() for k, v in b["params"].items())
    return loss, params


@pytest.mark.slow
@pytest.mark.models
@pytest.mark.parametrize(
    ("name", "world"), [(name, WORLD) for name in _CASES], ids=lambda v: str(v)
)
def test_zoo_model_trains_like_eager_with_overlap_on_equal_off(name: str, world: int) -> None:
    reference = _reference(name, compiled=False, world=world)
    results = run_ranks(world, _train_both, name, timeout=600)
    for result in results:
        on, off = result["on"], result["off"]
        assert on["losses"] == off["losses"], "overlap on and off differ"
        for key, value in off["params"].items():
            assert torch.equal(on["params"][key], value), f"overlap on and off differ at {key}"
    loss_diff, param_diff = max(_diffs(r["on"], reference) for r in results)
    floor = (0.0, 0.0)
    if _TABLE or loss_diff > 1e-5 or param_diff > 1e-4:
        floor = _diffs(_reference(name, compiled=True, world=world), reference)
    on = results[0]["on"]
    if _TABLE:
        print(f"\n| {name} | {world} | {_CASES[name].inner} | {on['numel']:,} | {on['buckets']} | {loss_diff:.1e} | {param_diff:.1e} | "
              f"{floor[0]:.1e} / {floor[1]:.1e} | bitwise | {results[0]['wall']:.0f} |")  # fmt: skip
    assert loss_diff <= max(1e-5, 2 * floor[0]), (loss_diff, floor)
    assert param_diff <= max(1e-4, 2 * floor[1]), (param_diff, floor)
    assert reference["moved"] > 10 * max(1e-4, 2 * floor[1]), "the params must move well past the tolerance"


_README_ROW = {"resnet": "timm resnet10t", "vit": "timm vit_tiny", "convnext": "timm convnext_atto",
               "efficientnet": "timm test_efficientnet", "t5": "HF T5", "mixtral": "HF Mixtral",
               "whisper": "HF Whisper", "routed_experts": "adapters routed"}  # fmt: skip


def test_the_zoo_results_table_names_each_models_inner_compiler() -> None:
    """The zoo table (benchmarks/results/zoo-2026-11-25.md, once the README's; its text: ResNet and the adapters under Inductor) says which
    inner compiler each model's test runs under: the one ``zoo.Case.inner`` gives it."""
    rows = [r for r in (Path(__file__).parents[1] / "benchmarks/results/zoo-2026-11-25.md").read_text().splitlines() if r.startswith(("| timm", "| HF", "| adapters"))]
    shown = {name: [r.split(" | ")[2] for r in rows if r.startswith(f"| {label} ")] for name, label in _README_ROW.items()}
    assert shown == {name: [case.inner.replace("inductor", "Inductor")] for name, case in _CASES.items()}
    assert {name for name, case in _CASES.items() if case.inner == "inductor"} == {"resnet", "routed_experts"}


def test_mixtral_runs_the_loop_over_the_experts_picked() -> None:
    """transformers 5 defaults Mixtral's experts to a grouped-matmul fallback; the zoo's
    Mixtral is the loop over the experts some token picked (its graph breaks on ``nonzero``)."""
    model = _build(_CASES["mixtral"])
    assert model.config._experts_implementation == "eager"


def test_the_zoo_keeps_every_regularisation_default() -> None:
    """Shrunk in depth and width only: every dropout-like setting of a Hugging Face model's config
    is its config class's default, and every timm model's dropout and drop path is timm's
    (``drop_rate`` and ``drop_path_rate`` default to 0)."""
    for name, case in ZOO.items():
        model = case.build()
        config = getattr(model, "config", None)
        if config is not None:
            defaults = type(config)()
            changed = {k: v for k, v in config.to_dict().items() if "drop" in k and v != getattr(defaults, k, v)}
            assert not changed, (name, changed)
        else:
            rates = {float(getattr(m, "p", getattr(m, "drop_prob", 0.0))) for m in model.modules() if "drop" in type(m).__name__.lower()}
            assert rates <= {0.0}, (name, rates)
    assert ZOO["t5"].build().config.dropout_rate > 0  # T5 ships dropout on, and trains with it here
