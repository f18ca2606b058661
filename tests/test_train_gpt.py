"""examples/train_gpt.py, trained through the example's own functions on gloo ranks (a small model,
eager): its log and --metrics file (world 1), --optimizer muon (torch.optim.Muon over the blocks' matrices with whole-param ownership and
AdamW over the rest, two DistributedOptimizers over one model, clipped by the whole model's norm),
and --tp 2 (a dp x tp mesh, TP blocks, ZeRO-1 over dp) against plain data parallelism."""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from fxzero import mxfp8
from fxzero.testing import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_gpt  # noqa: E402
import train_log  # noqa: E402

SMALL = ["--dim", "64", "--layers", "2", "--heads", "2", "--seq", "64", "--global-batch", "8", "--bucket-size", "20000"]
MUON = [*SMALL, "--optimizer", "muon", "--compile", "none", "--log-every", "1", "--lr", "1e-2"]
STEPS = 6


def _train(argv: list[str]) -> dict[str, Any]:
    """Run train_gpt's training loop on this rank (world 1 when no process group)."""
    args = train_gpt.build_parser().parse_args(argv)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    job = train_gpt.build_job(args, rank, world, torch.device("cpu"))
    losses, skipped, _ = train_gpt.train(job)
    return {
        "classes": {name: opt.optimizer_class.__name__ for name, opt in job.opts.items()},
        "whole_params": {name: opt.runtime.whole_params for name, opt in job.opts.items()},
        "losses": losses,
        "skipped": skipped,
        "params": {k: v.detach().clone() for k, v in job.model.state_dict().items()},
        "states": {name: opt.consolidated_state_dict()["state"] for name, opt in job.opts.items()},
    }


def _state_tensors(result: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {f"{name}/{slot}/{key}": value for name, state in result["states"].items()
            for slot, entries in state.items() for key, value in entries.items() if isinstance(value, torch.Tensor)}


@pytest.mark.slow
def test_muon_trains_at_world_2_like_world_1(tmp_path: Path) -> None:
    """Losses finite and falling; both optimizers' params and states the same on both ranks; the
    same math at world 1, whose metrics file logs the whole model's grad norm (clip_grad_norm_'s:
    two optimizers each see only their own params). Not to 1e-5: torch's Muon runs Newton-Schulz in bf16, which turns the
    fp32 rounding of averaging two ranks' gradients into bf16 rounding (losses of world 1 and 2
    differed by up to 6.3e-5 over 6 steps; with --optimizer adamw, by up to 7.2e-7)."""
    argv = [*MUON, "--steps", str(STEPS)]
    one = _train([*argv, "--metrics", str(tmp_path / "metrics.jsonl")])
    norms = [json.loads(line)["grad_norm"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()[1:]]
    assert len(norms) == STEPS and all(math.isfinite(n) and n > 0 for n in norms), norms
    ranks = run_ranks(2, _train, argv, timeout=300)
    assert one["classes"] == {"muon": "Muon", "adamw": "AdamW"} and one["whole_params"] == {"muon": True, "adamw": False}
    losses = ranks[0]["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0] - 0.5 and losses[-1] < min(losses[:-2]), losses
    assert ranks[0]["skipped"] == 0
    for name in ("params", "states"):
        flat = ranks[0][name] if name == "params" else _state_tensors(ranks[0])
        other = ranks[1][name] if name == "params" else _state_tensors(ranks[1])
        assert flat.keys() == other.keys() and all(torch.equal(flat[k], other[k]) for k in flat), name
    assert {k.split("/")[0] for k in _state_tensors(ranks[0])} == {"muon", "adamw"}
    torch.testing.assert_close(losses, one["losses"], atol=2e-4, rtol=0)
    for name, value in one["params"].items():  # 1.1% for wqkv (small, and moved mostly by Muon's bf16 steps)
        drift = float((ranks[0]["params"][name] - value).norm() / value.norm())
        assert drift < 3e-2, (name, drift)


@pytest.mark.slow
def test_muon_resumes_from_the_newest_step_both_optimizers_saved(tmp_path: Path) -> None:
    """A world-2 run saving both optimizers every 3 steps; its step-6 Muon checkpoint removed (a job
    killed between the two saves): a rerun resumes both from step 3 and ends where the first did."""
    argv = [*MUON, "--steps", str(STEPS), "--ckpt-dir", str(tmp_path), "--ckpt-every", "3"]
    first = run_ranks(2, _train, argv, timeout=300)[0]
    assert sorted(p.name for p in (tmp_path / "muon").iterdir()) == ["step_0000003", "step_0000006"]
    shutil.rmtree(tmp_path / "muon" / "step_0000006")
    again = run_ranks(2, _train, argv, timeout=300)[0]
    assert again["losses"] == first["losses"][3:]  # steps 4..6, bitwise
    for name, value in first["params"].items():
        assert torch.equal(again["params"][name], value), name
    want, got = _state_tensors(first), _state_tensors(again)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


# ---- the log and the metrics file ---------------------------------------------------------------
LINE = re.compile(r"^step +(\d+)/(\d+) \| loss ([\d.]+) \| lr ([\d.e+-]+) \| grad norm ([\d.]+) \| "
                  r"(?:([\d,]+) tok/s \| (\d+) ms/step|first step [\d.]+ s \(compiles\)) \| "
                  r"peak rss ([\d,]+) MiB \| ETA (\S+)$", re.M)


def test_the_default_data_is_the_standard_librarys_sources_in_path_order() -> None:
    """train_gpt's default data (what the recorded parity and loss figures ran on): the standard library's
    .py files outside site-packages, in sorted path order, cut at the limit; the walk skips site-packages
    instead of listing it, and must give the same bytes."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in stdlib.rglob("*.py") if "site-packages" not in f.parts)
    expected = b"\n".join(f.read_bytes() for f in files[:200])[:100_000]
    assert len(expected) == 100_000 and train_gpt.load_bytes(None, limit=100_000) == expected


def test_the_log_shows_each_steps_fields_and_the_metrics_file_holds_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """World 1, eager, 5 steps logged every 2: a line for steps 1, 2, 4 and 5 with step k/N, loss,
    lr, grad norm, tok/s, ms/step, peak memory and ETA; --metrics holds the run on its first line
    and one JSON object per logged line, with the same values (losses as train() returns them, the
    LR schedule's lr, StepResult's finite grad norm)."""
    metrics = tmp_path / "m" / "metrics.jsonl"
    argv = [*SMALL, "--compile", "none", "--steps", "5", "--log-every", "2", "--data", __file__]  # no stdlib scan
    run = _train([*argv, "--metrics", str(metrics)])
    lines = LINE.findall(capsys.readouterr().out)
    assert [(int(m[0]), int(m[1])) for m in lines] == [(1, 5), (2, 5), (4, 5), (5, 5)], lines
    head, *records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert head["run"]["world"] == 1 and head["run"]["steps"] == 5 and head["run"]["tokens_per_step"] == 8 * 64
    assert head["run"]["model"].startswith("GPT 0.12M params (dim 64, 2 layers") and head["run"]["machine"]
    args = train_gpt.build_parser().parse_args([*SMALL, "--steps", "5"])
    assert [r["step"] for r in records] == [1, 2, 4, 5] and [r["loss"] for r in records] == run["losses"]
    for record, line in zip(records, lines):
        assert record["lr"] == train_gpt.lr_at(record["step"], args) and f"{record['lr']:.2e}" == line[3]
        assert math.isfinite(record["grad_norm"]) and record["grad_norm"] > 0 and f"{record['grad_norm']:.3f}" == line[4]
        assert record["tok_per_s"] > 0 and record["memory_mib"] > 0 and record["memory"] == "peak rss"
        assert f"{record['tok_per_s']:,.0f}" == line[5] and f"{record['memory_mib']:,.0f}" == line[7]
        assert not record["includes_compile"] and record["eta_s"] >= 0
    assert records[-1]["eta_s"] == 0 and lines[-1][8] == "0s"


def test_a_compiled_run_says_it_compiles_before_its_first_step(capsys: pytest.CaptureFixture[str]) -> None:
    """The "compiling" line comes before step 1 runs; step 1's line gives its time, not a tok/s
    counting the compile, and no ETA; the next line's ETA is the mean step time since step 1's line."""
    log = train_log.TrainLog(10, 100, torch.device("cpu"), {}, enabled=True, compiles=True)
    log.start(1, "inductor")
    assert capsys.readouterr().out.startswith('compiling: step 1 runs torch.compile(backend="fxzero", inner compiler inductor)')
    first = log.step(1, 5.0, 1e-3, 1.5)
    second = log.step(3, 4.0, 1e-3, 1.2)
    out = capsys.readouterr().out
    assert first["includes_compile"] and first["eta_s"] is None and not second["includes_compile"]
    assert second["eta_s"] == pytest.approx(second["ms_per_step"] / 1000 * 7)  # 7 steps left at its pace
    (one, three) = LINE.findall(out)
    assert one[5] == "" and one[8] == "--" and three[5] and three[8] != "--", out


def test_tensorboard_without_the_package_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(train_gpt, "tensorboard_missing", lambda: True)
    parser = train_gpt.build_parser()
    with pytest.raises(SystemExit):
        train_gpt.check_args(parser, parser.parse_args(["--tensorboard", "runs"]), world=1)
    assert "--tensorboard needs the tensorboard package: pip install -e '.[tensorboard]'" in capsys.readouterr().err


# ---- --tp ---------------------------------------------------------------------------------------
TP_STEPS = 6
EAGER = [*SMALL, "--compile", "none", "--steps", str(TP_STEPS), "--log-every", "1"]


def _unpermuted(name: str, value: torch.Tensor, tp: int) -> torch.Tensor:
    """A param as the plain model holds it: wqkv's rows back from per-TP-rank [q_r; k_r; v_r] groups."""
    if not name.endswith("wqkv.weight"):
        return value
    return value.view(tp, 3, -1, value.shape[1]).transpose(0, 1).reshape(value.shape)


def _train_tp(argv: list[str]) -> dict[str, Any]:
    """train_gpt's loop on this rank; the params as full tensors (a collective with --tp)."""
    args = train_gpt.build_parser().parse_args(argv)
    job = train_gpt.build_job(args, dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    losses, skipped, _ = train_gpt.train(job)
    params = {name: _unpermuted(name, (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone(), args.tp)
              for name, p in job.model.named_parameters()}
    wqkv = job.model.layers[0].attention.wqkv.weight
    placements = tuple(wqkv.placements) if isinstance(wqkv, DTensor) else None
    return {"losses": losses, "skipped": skipped, "params": params, "wqkv": placements, "val": train_gpt.validate(job)}


@pytest.mark.slow
def test_tp2_at_world_4_trains_like_dp2_at_world_2() -> None:
    """--tp 2 at world 4 (dp 2 x tp 2: each dp rank's 1/2 of the global batch, its TP ranks on the
    same slice) against plain data parallelism at world 2 on the same global batches: losses
    within 1e-4 on every step, validation loss and every param (wqkv's rows put back in the
    plain order) within 1e-4; the TP ranks agree bitwise."""
    tp = run_ranks(4, _train_tp, [*EAGER, "--tp", "2"], timeout=300)
    dp = run_ranks(2, _train_tp, EAGER, timeout=300)[0]
    assert tp[0]["wqkv"] == (Shard(0),) and dp["wqkv"] is None  # the blocks really are tensor-parallel
    assert len(dp["losses"]) == TP_STEPS and dp["losses"][-1] < dp["losses"][0] - 0.5, dp["losses"]
    for rank, run in enumerate(tp):
        assert run["skipped"] == 0 and run["losses"] == tp[0]["losses"], (rank, run["losses"])
        torch.testing.assert_close(run["losses"], dp["losses"], atol=1e-4, rtol=0)
        assert abs(run["val"] - dp["val"]) <= 1e-4, (run["val"], dp["val"])
        assert run["params"].keys() == dp["params"].keys()
        for name, value in dp["params"].items():
            torch.testing.assert_close(run["params"][name], value, atol=1e-4, rtol=0, msg=name)


def _train_tp_variants(argvs: list[list[str]], ckpt_root: str) -> list[dict[str, Any]]:
    """Several --tp runs in one pool of ranks; ``{ckpt}`` in a flag is a fresh directory under
    ``ckpt_root``, and ``--resume-from-3`` (a test flag) first trims that directory to its step-3
    checkpoint, so the run resumes there."""
    runs = []
    for i, argv in enumerate(argvs):
        ckpt = Path(ckpt_root) / f"run{i}"
        if "--resume-from-3" in argv:
            argv = [a for a in argv if a != "--resume-from-3"]
            ckpt = Path(ckpt_root) / f"run{i - 1}"  # the previous run's checkpoints
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(ckpt / "step_0000006")
            dist.barrier()
        runs.append(_train_tp([a.replace("{ckpt}", str(ckpt)) for a in argv]))
    return runs


TP_VARIANTS = {  # name -> (flags, tolerance against the eager --tp 2 run; 0 = bitwise)
    "overlap": (["--overlap"], 0.0),
    "accum 2": (["--accum", "2"], 1e-5),
    "compiled (eager inner), overlap, accum 2": (["--compile", "eager", "--overlap", "--accum", "2"], 1e-4),
    "checkpointed every 3": (["--ckpt-dir", "{ckpt}", "--ckpt-every", "3"], 0.0),
    "resumed from step 3": (["--ckpt-dir", "{ckpt}", "--ckpt-every", "3", "--resume-from-3"], 0.0),
}


@pytest.mark.slow
def test_tp2_with_overlap_accumulation_compile_and_checkpoints_trains_like_plain_tp2(tmp_path: Path) -> None:
    """The main job's flags with --tp 2 at world 4, each against the plain eager --tp 2 run: overlapped
    param gathers bitwise; 2 microbatches per step (no_sync) within 1e-5 (another summation
    order); compiled with backend="fxzero" (eager inner compiler) with both, within 1e-4; saving
    checkpoints changes nothing, and a run resumed from its step-3 checkpoint (DTensor params
    saved in global shape) ends bitwise where the uninterrupted one does."""
    argvs = [[*EAGER, "--tp", "2"], *([*EAGER, "--tp", "2", *flags] for flags, _ in TP_VARIANTS.values())]
    base, *runs = run_ranks(4, _train_tp_variants, argvs, str(tmp_path), timeout=400)[0]
    for (name, (_, tol)), run in zip(TP_VARIANTS.items(), runs):
        losses = base["losses"][-len(run["losses"]):]  # a resumed run logs the steps it ran
        assert len(run["losses"]) == (3 if name.startswith("resumed") else TP_STEPS), (name, run["losses"])
        torch.testing.assert_close(run["losses"], losses, atol=tol, rtol=0, msg=name)
        for key, value in base["params"].items():
            torch.testing.assert_close(run["params"][key], value, atol=tol, rtol=0, msg=f"{name}: {key}")


def _train_tp_mxfp8(argv: list[str]) -> dict[str, Any]:
    """--tp 2 --mxfp8 on this rank; then, per bucket, whether this rank's shard of the gathered
    params is bitwise the MXFP8 round trip of its fp32 masters, and whether every DTensor param's
    local tensor lies inside the param buffer (the memory the gathers write)."""
    args = train_gpt.build_parser().parse_args(argv)
    job = train_gpt.build_job(args, dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    losses, skipped, _ = train_gpt.train(job)
    (opt,) = job.opts.values()
    round_trips = []
    for bucket, shard in zip(opt.runtime.buckets, opt.runtime.shards):
        gathered = bucket.param_shards[opt.dp.rank]
        round_trips.append(torch.equal(gathered, mxfp8.dequantize(*mxfp8.quantize(shard.main)).to(gathered.dtype)))
    spans = [(b.param_data.data_ptr(), b.param_data.data_ptr() + b.param_data.nbytes) for b in opt.runtime.buckets]
    inside = [any(lo <= p.to_local().data_ptr() < hi for lo, hi in spans) for p in job.model.parameters() if isinstance(p, DTensor)]
    return {"losses": losses, "skipped": skipped, "round_trips": round_trips, "inside": inside}


@pytest.mark.slow
def test_tp2_with_mxfp8_gather_computes_on_the_round_trip_of_its_masters() -> None:
    """--tp 2 --mxfp8 at world 4: after 6 steps each rank's shard of every bucket's gathered params
    is bitwise the MXFP8 round trip of its fp32 masters, every DTensor param's local tensor is in
    the param buffer, and the losses stay within 0.05 of the unquantized --tp 2 run's (the
    quantization's own error; blocks run along each local tensor, so not bitwise the plain run's)."""
    runs = run_ranks(4, _train_tp_mxfp8, [*EAGER, "--tp", "2", "--mxfp8"], timeout=300)
    plain = run_ranks(4, _train_tp, [*EAGER, "--tp", "2"], timeout=300)[0]
    for rank, run in enumerate(runs):
        assert run["skipped"] == 0 and run["round_trips"] and all(run["round_trips"]), (rank, run["round_trips"])
        assert run["inside"] and all(run["inside"]), (rank, run["inside"])
        torch.testing.assert_close(run["losses"], plain["losses"], atol=0.05, rtol=0)
        assert run["losses"] != plain["losses"]  # the gather really quantized


@pytest.mark.parametrize(("flags", "message"), [
    (["--tp", "3"], "--tp 3 must divide the world size 4"),
    (["--tp", "2", "--compile", "none", "--optimizer", "muon"], "--optimizer muon is not supported with --tp 2 yet"),
    (["--tp", "4", "--compile", "none", "--heads", "2"], "--tp 4 must divide --heads 2"),
    (["--instances", "3"], "--instances 3 must divide the world size 4"),
    (["--instances", "2", "--tp", "2"], "--instances 2 is not supported with --tp"),
    (["--instances", "2", "--optimizer", "muon"], "--instances 2 is not supported with --optimizer muon"),
    (["--tp", "2", "--compile", "none", "--global-batch", "3"], "divisible by dp * accum (dp = world / tp = 2) = 2"),
])  # fmt: skip
def test_tp_refusals_name_the_flag(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = train_gpt.build_parser()
    with pytest.raises(SystemExit):
        train_gpt.check_args(parser, parser.parse_args(flags), world=4)
    assert message in capsys.readouterr().err


def test_default_and_tp_runs_pass_the_checks(capsys: pytest.CaptureFixture[str]) -> None:
    parser = train_gpt.build_parser()
    for flags, world in (([], 2), (["--tp", "2"], 4), (["--tp", "2", "--overlap", "--accum", "2", "--ckpt-dir", "x"], 4), (["--tp", "1", "--mxfp8"], 2)):
        train_gpt.check_args(parser, parser.parse_args(flags), world=world)  # no SystemExit
    assert capsys.readouterr().err == ""
