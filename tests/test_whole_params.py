"""Whole-param ownership (``Config.state_sharding``, issue 23) around the step.

Each multi-rank test trains fxzero on N ranks, each on its slice of the global batch, and in
the same rank process plain ``torch.optim`` on the average of every slice's gradients (what
DDP would hand it; computed here from every slice, as ``tests/test_optim_db.py`` does). The
two agree within 1e-6; where they agree bit for bit the test says so and asserts it (the
ranks average gradients with the same arithmetic as the reference: ``(g0 + g1) / 2``).

Covered in ownership mode: ``Config.clip_grad``, ``opt.clip_grad_norm_``,
``torch.nn.utils.clip_grad_norm_`` on ``p.grad`` views and ``StepResult.grad_norm``;
``torch.amp.GradScaler`` with an overflowing step; checkpoints saved at world 2 and resumed at
world 1 (Adafactor's row/column statistics, Muon + AdamW); ``state_dict()`` and
``consolidated_state_dict()`` round trips; the MXFP8 param gather; two optimizers (Muon over the
hidden matrices, AdamW over the rest) under the ``fxzero`` backend and eagerly; ``explain``'s
ownership table; and layouts with more ranks than params (plan tests without a process group).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

import fxzero
from fxzero.optim import plan_buckets
from fxzero.optim.layout.layout import param_start_alignment, shard_fragments
from fxzero.optim.layout.ownership import balance, plan_owned_buckets
from fxzero.testing import run_ranks

from models import batch, build, loss_fn, param_groups
from test_mxfp8_gather import _round_trip

LR, MUON_LR, CLIP, GLOBAL, STEPS, INF_STEP = 1e-2, 2e-2, 0.05, 8, 4, 2


# ---- what a run builds --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Run:
    model: str = "mlp"
    optimizer: str = "adafactor"
    """``"adafactor"`` (whole params by default), ``"adamw"`` (with ``state_sharding``) or
    ``"muon+adamw"`` (Muon over the blocks' matrices, AdamW over the rest: two optimizers)."""
    sharding: str = "auto"
    clip: str = "none"
    """``"none"``, ``"config"`` (Config.clip_grad), ``"opt"`` (opt.clip_grad_norm_) or
    ``"torch"`` (torch.nn.utils.clip_grad_norm_ over model.parameters(), on p.grad views)."""
    scaler: bool = False
    compiled: bool = False
    """torch.compile(model, backend="fxzero"), Inductor as the inner compiler (the default)."""
    overlap: bool = False
    mxfp8: bool = False
    reuse: bool = False
    bucket: int = 2000
    steps: int = STEPS


def _optimizers_of(model: torch.nn.Module, run: Run) -> list[tuple[type, list[dict], dict]]:
    """(class, param groups, keyword arguments) of each optimizer of ``run``."""
    if run.optimizer == "adafactor":
        return [(torch.optim.Adafactor, param_groups(model), {"lr": LR})]
    if run.optimizer == "adamw":
        return [(torch.optim.AdamW, param_groups(model), {"lr": LR})]
    hidden = [p for name, p in model.named_parameters() if p.dim() == 2 and name.startswith(("blocks.", "fc2."))]
    rest = [p for p in model.parameters() if all(p is not q for q in hidden)]
    return [(torch.optim.Muon, [{"params": hidden}], {"lr": MUON_LR}), (torch.optim.AdamW, [{"params": rest}], {"lr": LR})]


def _config(run: Run) -> fxzero.Config:
    return fxzero.Config(
        bucket_size=run.bucket,
        state_sharding=run.sharding,
        clip_grad=CLIP if run.clip == "config" else None,
        overlap_param_gather=run.overlap,
        mxfp8_param_gather=run.mxfp8,
        reuse_grad_buf_for_mxfp8_param_ag=run.reuse,
    )


class _Chain(torch.nn.Module):
    """Five equal matrices on the MLP's data: at dp=4 the last four fill a bucket, one each,
    and the first, marked ``shared_embedding`` (a bucket of its own), is alone in the last
    bucket, where three ranks own nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16, bias=False) for _ in range(5))
        self.layers[0].weight.shared_embedding = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x[:, :8]


def _build(name: str, seed: int) -> torch.nn.Module:
    """``models.build``, plus ``"linear"`` (one Linear, 2 params: fewer than 4 ranks) and
    ``"chain"`` (:class:`_Chain`), both on the MLP's data."""
    if name in ("linear", "chain"):
        torch.manual_seed(seed)
        return torch.nn.Linear(16, 8) if name == "linear" else _Chain()
    return build(name, seed=seed)


def _fxzero(run: Run, seed: int = 0) -> tuple[torch.nn.Module, list[fxzero.DistributedOptimizer]]:
    model = _build(run.model, seed)
    opts = [
        fxzero.DistributedOptimizer(groups, cls, config=_config(run), module=model, **kwargs)
        for cls, groups, kwargs in _optimizers_of(model, run)
    ]
    return model, opts


def _plain(run: Run, seed: int = 0) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    """The plain model and optimizers; under ``run.mxfp8`` the optimizers step fp32 masters
    (``model._masters``) and the model computes on their MXFP8 round trip, as the gather makes it."""
    model = _build(run.model, seed)
    optimizers = _optimizers_of(model, run)
    if run.mxfp8:
        masters = {id(p): p.detach().clone() for p in model.parameters()}
        model._masters = [(p, masters[id(p)]) for p in model.parameters()]
        optimizers = [(cls, [g | {"params": [masters[id(p)] for p in g["params"]]} for g in groups], kw) for cls, groups, kw in optimizers]
    return model, [cls(groups, **kwargs) for cls, groups, kwargs in optimizers]


@torch.no_grad()
def _publish_round_trip(model: torch.nn.Module) -> None:
    for param, master in model._masters:
        param.copy_(_round_trip(master))


def _slice(run: Run, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(run.model, step, GLOBAL)
    size = GLOBAL // world
    return x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]


def _local_loss(run: Run, model: Any, step: int, rank: int, world: int) -> torch.Tensor:
    x, y = _slice(run, step, rank, world)
    loss = loss_fn(run.model, model(x), y)
    return loss * math.inf if run.scaler and step == INF_STEP and rank == 0 else loss  # rank 0 overflows


def _scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)


# ---- one fxzero step and one DDP-equivalent plain step ------------------------------------------
def _fxzero_step(run: Run, forward: Any, model: torch.nn.Module, opts: list, scaler: Any, step: int) -> dict:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    loss = _local_loss(run, forward, step, rank, world)
    (scaler.scale(loss) if scaler else loss).backward()
    if scaler and run.clip != "none":  # else scaler.step unscales (fxzero gets grad_scale and found_inf)
        for opt in opts:
            scaler.unscale_(opt)
    grad_norms = [float(p.grad.norm()) for p in model.parameters()]  # p.grad views: global norms
    clipped = None
    if run.clip == "opt":
        clipped = float(opts[0].clip_grad_norm_(CLIP))
    elif run.clip == "torch":
        clipped = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    results = [scaler.step(opt) if scaler else opt.step() for opt in opts]
    if scaler:
        scaler.update()
    for opt in opts:
        opt.zero_grad()
    return {
        "grad_norms": grad_norms,
        "clipped": clipped,
        "step_norms": [r.grad_norm for r in results],
        "skipped": [r.skipped for r in results],
        "scale": scaler.get_scale() if scaler else None,
    }


def _plain_step(run: Run, model: torch.nn.Module, opts: list, scaler: Any, step: int, world: int, forward: Any = None) -> dict:
    """DDP's step: every slice's gradients averaged, then the same habit and the plain optimizers."""
    grads = []
    for rank in range(world):
        model.zero_grad()
        loss = _local_loss(run, model if forward is None else forward, step, rank, world)
        (scaler.scale(loss) if scaler else loss).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for p, *gs in zip(model.parameters(), *grads):
        p.grad = (gs[0] + gs[1]) / 2 if world == 2 else sum(gs[1:], gs[0]) / world
    for param, master in getattr(model, "_masters", ()):
        master.grad = param.grad  # the same tensor: clipping and unscaling act on both
    if scaler and run.clip != "none":
        for opt in opts:
            scaler.unscale_(opt)
    grad_norms = [float(p.grad.norm()) for p in model.parameters()]
    clipped = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)) if run.clip in ("opt", "torch") else None
    # what each step() finds (unscaled): after a clip by hand, before Config.clip_grad's
    unscale = scaler.get_scale() if scaler and run.clip == "none" else 1.0
    step_norms = [_norm(opt) / unscale for opt in opts]
    if run.clip == "config":
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    for opt in opts:
        scaler.step(opt) if scaler else opt.step()
    if scaler:
        scaler.update()
    if hasattr(model, "_masters"):
        _publish_round_trip(model)
    model.zero_grad()
    return {"grad_norms": grad_norms, "clipped": clipped, "step_norms": step_norms, "scale": scaler.get_scale() if scaler else None}


def _norm(opt: torch.optim.Optimizer) -> float:
    return float(torch.nn.utils.get_total_norm([p.grad for g in opt.param_groups for p in g["params"]]))


def _max_diff(model: torch.nn.Module, reference: torch.nn.Module) -> dict[str, float]:
    """max |difference| of each param (every name of a tied weight: both must hold its value)."""
    ref = dict(reference.named_parameters(remove_duplicate=False))
    return {n: (p.detach() - ref[n].detach()).abs().max().item() for n, p in model.named_parameters(remove_duplicate=False)}


def _train(run: Run) -> dict:
    """fxzero on this rank's slices next to the DDP-equivalent plain run; every step's records."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    model, opts = _fxzero(run)
    forward = torch.compile(model, backend="fxzero") if run.compiled else model
    reference, plain = _plain(run)
    reference_forward = torch.compile(reference) if run.compiled else reference  # Inductor's arithmetic on both sides
    scaler, plain_scaler = (_scaler(), _scaler()) if run.scaler else (None, None)
    steps, expected = [], []
    for step in range(run.steps):
        steps.append(_fxzero_step(run, forward, model, opts, scaler, step))
        expected.append(_plain_step(run, reference, plain, plain_scaler, step, world, reference_forward))
    for opt in opts:
        opt.finish_param_sync()
    whole = [o.runtime.whole_params for o in opts]
    owners = [[row.owner for row in opts[0].param_table.rows if row.bucket == b.index] for b in opts[0].runtime.buckets]
    return {"steps": steps, "expected": expected, "diff": _max_diff(model, reference), "whole": whole, "params": _params(model)} | {
        "owners": owners  # per bucket of the first optimizer, its params' owners
    }


def _assert_matches(result: dict, atol: float = 1e-6) -> None:
    """Norms within 1e-6 (relative; non-finite ones non-finite on both), params within ``atol``."""
    for step, (got, want) in enumerate(zip(result["steps"], result["expected"])):
        for key in ("grad_norms", "step_norms"):
            finite = [math.isfinite(v) for v in want[key]]
            assert [math.isfinite(v) for v in got[key]] == finite, (step, key, got[key], want[key])
            pairs = [(a, b) for a, b, f in zip(got[key], want[key], finite) if f]
            torch.testing.assert_close([a for a, _ in pairs], [b for _, b in pairs], rtol=1e-6, atol=1e-7, msg=f"{key} {step}")
        if want["clipped"] is not None:
            torch.testing.assert_close(got["clipped"], want["clipped"], rtol=1e-6, atol=1e-7, equal_nan=True)
        assert got["scale"] == want["scale"], step
    assert max(result["diff"].values()) <= atol, result["diff"]


# ---- 1. clipping, StepResult.grad_norm and p.grad views ---------------------------------------
@pytest.mark.parametrize("clip", ["none", "config", "opt", "torch"])
@pytest.mark.parametrize(("optimizer", "sharding"), [("adafactor", "auto"), ("adamw", "whole_params")])
def test_clipping_and_grad_norms_match_ddp_at_world_2(optimizer: str, sharding: str, clip: str) -> None:
    """Params are bitwise those of plain torch.optim, except under Config.clip_grad and
    opt.clip_grad_norm_ (<= 1.2e-7 seen): fxzero sums the per-param squared norms in fp64,
    clip_grad_norm_ stacks fp32 norms, so the clip factors differ in their last bits."""
    run = Run(optimizer=optimizer, sharding=sharding, clip=clip)
    for result in run_ranks(2, _train, run):
        assert result["whole"] == [True]
        _assert_matches(result, atol=1e-6 if clip in ("config", "opt") else 0.0)


# ---- 2. torch.amp.GradScaler -------------------------------------------------------------------
@pytest.mark.parametrize("clip", ["none", "torch"], ids=["scaler.step", "unscale_-clip-step"])
@pytest.mark.parametrize(("optimizer", "sharding"), [("adafactor", "auto"), ("adamw", "whole_params")])
def test_grad_scaler_skips_the_overflowing_step_on_every_rank(optimizer: str, sharding: str, clip: str) -> None:
    """Rank 0's loss is inf at step 2: both ranks skip it and back the scale off, as DDP
    would; params bitwise like plain torch.optim's."""
    run = Run(optimizer=optimizer, sharding=sharding, clip=clip, scaler=True)
    for result in run_ranks(2, _train, run):
        assert [s["skipped"] for s in result["steps"]] == [[step == INF_STEP] for step in range(STEPS)]
        scales = [s["scale"] for s in result["steps"]]
        assert scales[INF_STEP] == scales[INF_STEP - 1] / 2  # backed off (it grows by 2 on the others)
        _assert_matches(result, atol=0.0)


# ---- 3. checkpoints saved at world 2, resumed at world 1; state dict round trips -----------------
K = 3  # steps before and after the checkpoint


def _two_slice_step(run: Run, model: torch.nn.Module, opts: list, step: int) -> None:
    """One step on the global batch's two slices at any world size: at world 1 both slices
    are microbatches (the first under no_sync), each loss halved, so the gradient is exactly
    the world-2 average ``g0 / 2 + g1 / 2 == (g0 + g1) / 2``."""
    world = dist.get_world_size()
    mine = [dist.get_rank()] if world == 2 else [0, 1]
    for i, rank in enumerate(mine):
        last = i == len(mine) - 1
        with contextlib.ExitStack() as stack:
            if not last:
                for opt in opts:
                    stack.enter_context(opt.no_sync())
            (_local_loss(run, model, step, rank, 2) / len(mine)).backward()
    for opt in opts:
        assert not opt.step().skipped
        opt.zero_grad()


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _consolidated(opts: list) -> list[dict]:
    return [copy.deepcopy(opt.consolidated_state_dict()) for opt in opts]


def _save_at_world_2(run: Run, ckpt_dir: str) -> dict:
    model, opts = _fxzero(run)
    for step in range(K):
        _two_slice_step(run, model, opts, step)
    for i, opt in enumerate(opts):
        fxzero.save_checkpoint(Path(ckpt_dir) / f"opt{i}", model, opt, step=K)
    saved = {"consolidated": _consolidated(opts), "params": _params(model)}
    # the same-world-size round trip: state_dict() into a fresh optimizer over a fresh model
    # (copies: torch.optim's loader keeps same-dtype tensors as given, the two runs would share them)
    rank_states, model_state = copy.deepcopy([opt.state_dict() for opt in opts]), copy.deepcopy(model.state_dict())
    twin, twin_opts = _fxzero(run, seed=1)
    twin.load_state_dict(model_state)
    for opt, state in zip(twin_opts, rank_states):
        opt.load_state_dict(state)
    for step in range(K, 2 * K):
        _two_slice_step(run, model, opts, step)
        _two_slice_step(run, twin, twin_opts, step)
    return saved | {"uninterrupted": _params(model), "twin": _params(twin), "whole": [o.runtime.whole_params for o in opts]}


def _resume_at_world_1(run: Run, ckpt_dir: str, consolidated: list[dict]) -> dict:
    model, opts = _fxzero(run, seed=1)  # other values: the load must overwrite them
    for i, opt in enumerate(opts):
        info = fxzero.load_checkpoint(fxzero.latest_checkpoint(Path(ckpt_dir) / f"opt{i}"), model, opt)
        assert info["step"] == K
    loaded = {"consolidated": _consolidated(opts), "params": _params(model)}
    # the consolidated state dict: into a DistributedOptimizer at world 1, and into plain torch.optim
    again, again_opts = _fxzero(run, seed=1)
    again.load_state_dict(loaded_model_state := copy.deepcopy(model.state_dict()))
    for opt, state in zip(again_opts, consolidated):
        opt.load_state_dict(copy.deepcopy(state))
    plain, plain_opts = _plain(run, seed=1)
    plain.load_state_dict(loaded_model_state)
    for opt, state in zip(plain_opts, consolidated):
        opt.load_state_dict(copy.deepcopy(state))
    for step in range(K, 2 * K):
        _two_slice_step(run, model, opts, step)
        _two_slice_step(run, again, again_opts, step)
        _plain_step(run, plain, plain_opts, None, step, 2)
    return loaded | {"resumed": _params(model), "from_consolidated": _params(again), "plain": _params(plain)}


def _assert_state_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_state_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_state_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _assert_params(got: dict, want: dict, atol: float = 0.0) -> None:
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, atol=atol, rtol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("run", [Run(), Run(model="gpt", optimizer="muon+adamw")], ids=["adafactor-mlp", "muon+adamw-gpt"])
def test_checkpoint_saved_at_world_2_resumes_at_world_1_like_the_uninterrupted_run(tmp_path: Path, run: Run) -> None:
    """Adafactor's row_var/col_var are not param-shaped (kept whole by the owner); Muon and
    AdamW are two optimizers with a checkpoint each. The full state comes back bit for bit;
    the resumed run, the optimizer loaded from consolidated_state_dict() and plain torch.optim
    loaded from it end where the uninterrupted world-2 run ends."""
    saved = run_ranks(2, _save_at_world_2, run, str(tmp_path))
    assert saved[0]["whole"] == ([True] if run.optimizer == "adafactor" else [True, False])  # AdamW: fragments ("auto")
    _assert_state_equal(saved[0]["consolidated"], saved[1]["consolidated"])
    if run.optimizer == "adafactor":  # the factored statistics of a matrix are in it, shaped as torch.optim's
        fc2 = saved[0]["consolidated"][0]["state"][1]  # slot 1: fc2.weight (48 x 48)
        assert fc2["row_var"].shape == (48, 1) and fc2["col_var"].shape == (1, 48), fc2.keys()
    (resumed,) = run_ranks(1, _resume_at_world_1, run, str(tmp_path), saved[0]["consolidated"])
    _assert_state_equal(resumed["consolidated"], saved[0]["consolidated"])
    _assert_params(resumed["params"], saved[0]["params"])
    for rank in saved:
        _assert_params(rank["twin"], rank["uninterrupted"])  # state_dict() round trip at world 2: bitwise
    for key in ("resumed", "from_consolidated", "plain"):  # bitwise: the same gradients, the same arithmetic
        _assert_params(resumed[key], saved[0]["uninterrupted"])


# ---- 4. the MXFP8 param gather --------------------------------------------------------------------
def _mxfp8_pair(run: Run) -> dict:
    """The same run in whole-param and in elementwise mode (AdamW may take either)."""
    whole = _train(run)
    fragments = _train(dataclasses.replace(run, sharding="elementwise"))
    return {"whole": whole, "fragments": fragments}


@pytest.mark.parametrize("reuse", [False, True], ids=["own-gather-buffer", "reuse-grad-buffer"])
def test_mxfp8_gather_in_whole_param_mode(reuse: bool) -> None:
    """Adafactor (whole params) and AdamW under state_sharding="whole_params" gather MXFP8:
    each matches plain torch.optim stepping fp32 masters on DDP's gradients with the model
    computing on the masters' MXFP8 round trip; AdamW's params equal its elementwise-mode run."""
    for result in run_ranks(2, _train, Run(optimizer="adafactor", mxfp8=True, reuse=reuse, clip="config")):
        assert result["whole"] == [True]
        _assert_matches(result)
        for name, value in result["params"].items():
            assert torch.equal(_round_trip(value), value), f"{name} is not MXFP8-representable"
    adamw = Run(optimizer="adamw", sharding="whole_params", mxfp8=True, reuse=reuse, overlap=True)
    for result in run_ranks(2, _mxfp8_pair, adamw):
        assert result["whole"]["whole"] == [True] and result["fragments"]["whole"] == [False]
        _assert_matches(result["whole"])
        _assert_matches(result["fragments"])
        _assert_params(result["whole"]["params"], result["fragments"]["params"])  # bitwise


# ---- 5. two optimizers over one model: Muon over the hidden matrices, AdamW over the rest ----------
_MUON_ADAMW = Run(model="gpt", optimizer="muon+adamw")


@pytest.mark.parametrize("overlap", [False, True], ids=["gather-in-step", "gather-overlaps-forward"])
def test_muon_and_adamw_over_one_eager_model_match_plain_at_world_2(overlap: bool) -> None:
    """Muon (whole params) over the blocks' matrices, AdamW (fragments) over embeddings, norms
    and biases: bitwise like plain Muon + AdamW on DDP's gradients."""
    for result in run_ranks(2, _train, dataclasses.replace(_MUON_ADAMW, overlap=overlap)):
        assert result["whole"] == [True, False]
        _assert_matches(result, atol=0.0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [{"overlap": False}, {"overlap": True}, {"overlap": True, "mxfp8": True, "reuse": True}],
    ids=["gather-in-step", "gather-overlaps-forward", "mxfp8-gather-in-the-grad-buffer"],
)
def test_muon_and_adamw_under_the_fxzero_backend_with_inductor_match_plain_at_world_2(options: dict) -> None:
    """The same through torch.compile(model, backend="fxzero") with Inductor; the plain model
    is compiled by Inductor too (its kernels round as fxzero's do): bitwise, the MXFP8 gather
    included (the plain model then computes on its masters' MXFP8 round trip)."""
    run = dataclasses.replace(_MUON_ADAMW, compiled=True, **options)
    for result in run_ranks(2, _train, run, timeout=600):
        assert result["whole"] == [True, False]
        _assert_matches(result, atol=0.0)


def test_muon_and_adamw_clip_and_scale_together_over_p_grad_views() -> None:
    """One clip_grad_norm_ over model.parameters() spans both optimizers' p.grad views, and one
    GradScaler steps both, skipping the overflowing step in both. Both optimizers own whole
    params here: an elementwise AdamW's per-param norms are summed from fragments (last-bit
    differences that Muon's bf16 Newton-Schulz turns into 1e-4 after a few steps)."""
    run = dataclasses.replace(_MUON_ADAMW, sharding="whole_params", clip="torch", scaler=True)
    for result in run_ranks(2, _train, run):
        assert result["whole"] == [True, True]
        assert [s["skipped"] for s in result["steps"]] == [[step == INF_STEP] * 2 for step in range(STEPS)]
        _assert_matches(result, atol=0.0)


# ---- 6. explain names each param's owner ------------------------------------------------------------
def _explain_owners() -> dict:
    model, (opt,) = _fxzero(Run())
    text = fxzero.explain(model, _slice(Run(), 0, dist.get_rank(), 2)[0], optimizer=opt, inner_compiler="eager", full=True)
    return {"text": text, "owners": {row.label: row.owner for row in opt.param_table.rows}, "balance": opt.balance}


def _ownership_rows(text: str) -> dict[int, list[str]]:
    """``rank -> the params explain's ownership table (a row per param) says it owns``."""
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("|") and line.rstrip("| ").endswith("elements") and "param" in line)
    rows: dict[int, list[str]] = {}
    for line in lines[header + 2 :]:
        if not line.startswith("|"):
            break
        rank, label, _, _ = (cell.strip() for cell in line.strip("|").split("|"))
        rows.setdefault(int(rank), []).append(label)
    return rows


def test_explain_at_world_2_names_the_rank_owning_each_param() -> None:
    results = run_ranks(2, _explain_owners)
    assert results[0]["text"] == results[1]["text"] and results[0]["owners"] == results[1]["owners"]
    text, owners, bal = results[0]["text"], results[0]["owners"], results[0]["balance"]
    assert len(owners) == 8 and set(owners.values()) == {0, 1}, owners
    rows = _ownership_rows(text)
    assert {rank: sorted(labels) for rank, labels in rows.items()} == {
        rank: sorted(label for label, owner in owners.items() if owner == rank) for rank in (0, 1)
    }
    assert " ".join(bal.describe().split()) in " ".join(text.split()) and "rank 0:" in bal.describe() and "rank 1:" in bal.describe()
    assert bal.elements == tuple(sum(_build("mlp", 0).get_parameter(n).numel() for n, o in owners.items() if o == r) for r in (0, 1))


# ---- 7. more ranks than params: plans (no process group) and training at world 4 ---------------------
def _meta(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.empty(shape, device="meta", dtype=dtype) for shape in shapes]


def _check_owned_plan(params: list[torch.Tensor], dp: int, bucket_size: Optional[int], shard_multiple: int = 1) -> Any:
    """Every guarantee a whole-param plan makes, checked from the plan alone."""
    plan = plan_owned_buckets(params, dp_size=dp, bucket_size=bucket_size, shard_multiple=shard_multiple)
    assert plan.owners is not None and len(plan.owners) == len(plan.param_ranges) == len(params)
    assert sorted(i for b in plan.buckets for i in b.param_indices) == list(range(len(params)))  # each in one bucket
    position = 0
    for bucket in plan.buckets:
        assert bucket.start == position and bucket.numel % dp == 0  # contiguous, equal shards
        shard = bucket.shard_numel(dp)
        assert shard % math.lcm(64, shard_multiple) == 0 and shard > 0, shard
        position = bucket.end
    assert plan.numel == position
    taken: list[tuple[int, int]] = []
    for index, ((start, end, bucket_id), owner) in enumerate(zip(plan.param_ranges, plan.owners)):
        bucket = plan.buckets[bucket_id]
        lo = bucket.start + owner * bucket.shard_numel(dp)
        assert lo <= start and end <= lo + bucket.shard_numel(dp), (index, owner)  # whole, in its owner's shard
        assert end - start == params[index].numel()
        assert start % param_start_alignment(params[index].numel(), params[index].element_size(), shard_multiple) == 0
        taken.append((start, end))
    taken.sort()
    assert all(a[1] <= b[0] for a, b in zip(taken, taken[1:]))  # no overlap
    for rank in range(dp):  # the fragments a rank's optimizer gets are exactly its params, whole
        fragments = shard_fragments(plan, rank)
        assert sorted(f.param_index for f in fragments) == sorted(i for i, o in enumerate(plan.owners) if o == rank)
        assert all(f.param_offset == 0 and f.numel == params[f.param_index].numel() for f in fragments)
    return plan


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("bucket_size", [None, 64, 1000, 100_000])
def test_owned_plans_keep_every_guarantee(dp: int, bucket_size: Optional[int]) -> None:
    params = _meta((48, 16), (48,), (48,), (48,), (48, 48), (48,), (8, 48), (8,), (3,), (1,), (130, 7))
    plan = _check_owned_plan(params, dp, bucket_size)
    _check_owned_plan(params, dp, bucket_size, shard_multiple=32)  # the MXFP8 gather's blocks
    if dp > len(params):
        assert len(set(plan.owners)) == len(params)  # one param each: the other ranks own nothing
    else:  # dealt by size: no rank owns more than the largest param above the mean
        owned = balance([plan], [params]).elements
        assert max(owned) - sum(owned) / dp <= max(p.numel() for p in params), owned


def test_more_ranks_than_params_leaves_ranks_with_empty_shards() -> None:
    params = _meta((8, 16), (8,))
    plan = _check_owned_plan(params, 4, 64)
    assert len(plan.buckets) == 1 and sorted(plan.owners) == [0, 1]
    assert [shard_fragments(plan, rank) == () for rank in range(4)] == [False, False, True, True]
    bal = balance([plan], [params])
    assert bal.elements == (128, 8, 0, 0) and bal.params == (1, 1, 0, 0)  # the largest param first
    # a bucket of one param per rank at dp=4: every bucket of a many-param model has ranks owning one
    many = _check_owned_plan(_meta(*[(100,)] * 10), 4, 16)
    assert all(len(b.param_indices) >= 4 for b in many.buckets[:-1])  # a bucket closes once every rank has a region


def test_many_equal_params_are_dealt_evenly_and_the_elementwise_plan_is_untouched() -> None:
    params = _meta(*[(1000,)] * 100)
    plan = _check_owned_plan(params, 4, 10_000)
    bal = balance([plan], [params])
    assert bal.params == (25, 25, 25, 25) and bal.imbalance == 1.0
    assert plan_buckets(params, dp_size=4, bucket_size=10_000).owners is None


@pytest.mark.slow  # a pool of 4 ranks on this machine's 2 cores
@pytest.mark.parametrize(
    ("run", "owners"),
    [(Run(model="linear"), [[0, 1]]), (Run(model="chain", bucket=1024, clip="config"), [[0, 1, 2, 3], [0]])],
    ids=["2-params", "5-params-in-2-buckets"],
)
def test_training_at_world_4_with_ranks_owning_nothing(run: Run, owners: list) -> None:
    """Adafactor at world 4: a Linear (ranks 2 and 3 own nothing at all) and five matrices in
    two buckets (ranks 1 to 3 own nothing in the second): like plain on DDP's gradients."""
    for result in run_ranks(4, _train, run, timeout=300):
        assert result["whole"] == [True] and [sorted(o) for o in result["owners"]] == owners
        _assert_matches(result)


def test_the_example_gpts_hidden_matrices_split_evenly_over_two_ranks() -> None:
    """The README's Muon run: its 16 matrices, dealt whole to 2 ranks, need no padding."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    try:
        from train_gpt import ModelArgs, Transformer
    finally:
        sys.path.pop(0)
    with torch.device("meta"):
        model = Transformer(ModelArgs())
    hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("layers.")]
    assert len(hidden) == 16
    plan = _check_owned_plan(hidden, 2, 1_000_000)
    bal = balance([plan], [hidden])
    assert bal.padding == 0 and bal.elements == (1_572_864, 1_572_864)
