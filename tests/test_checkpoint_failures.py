"""Checkpoint calls that go wrong on some ranks: every rank raises a CheckpointError (an
Exception, not DCP's BaseException), within seconds, and nothing half-written stays behind.

* a save that fails on one or all ranks (full disk, read-only file system, a path under a
  file, a failure in fxzero's own hashing step) removes its ``.tmp-`` directory, and the
  ranks can go on saving;
* a save called on one rank only, or ranks calling different things (save vs load, other
  steps), fails at the call's handshake instead of blocking until the process group's timeout.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import pytest
import torch.distributed as dist

import fxzero
import fxzero.checkpoint.ranks
from fxzero.testing import RankPool, run_ranks

from test_checkpoint import _make, _train

ARRIVAL = 2.0  # seconds: the handshake timeout the tests use (the default is the process group's)


def _disk_full(self: Any, plan: Any, planner: Any) -> None:
    """Rank 1's writer: half a file, then ENOSPC, as a full disk does."""
    (Path(self.path) / "__1_0.distcp").write_bytes(b"half a tensor")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))


def _read_only(self: Any, plan: Any) -> Any:
    """Rank 0 cannot create the directory (root ignores chmod, so the error is injected)."""
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self.path))


def _hashing_fails(files: Any) -> Any:
    raise OSError(errno.EIO, os.strerror(errno.EIO), "a data file")


def _patched(obj: Any, name: str, value: Any, on_rank: int) -> Callable[[], Any]:
    """A context in which ``obj.name`` is ``value`` on rank ``on_rank`` only."""

    @contextlib.contextmanager
    def patch() -> Iterator[None]:
        old = getattr(obj, name)
        if dist.get_rank() == on_rank:
            setattr(obj, name, value)
        try:
            yield
        finally:
            setattr(obj, name, old)

    return patch


def _saves_that_fail(ckpt_dir: str) -> dict[str, str]:
    import torch.distributed.checkpoint as dcp

    import fxzero.checkpoint.io as ckpt

    root, (model, opt) = Path(ckpt_dir), _make("mlp", 2000)
    _train("mlp", model, opt, range(1))
    fxzero.save_checkpoint(root, model, opt, step=1)
    if dist.get_rank() == 0:
        (root / "a_file").write_text("not a directory")
    dist.barrier()
    cases = {
        "disk full on rank 1": (root, _patched(dcp.FileSystemWriter, "write_data", _disk_full, 1)),
        "read-only on rank 0": (root, _patched(dcp.FileSystemWriter, "prepare_local_plan", _read_only, 0)),
        "hashing fails on rank 1": (root, _patched(ckpt, "_describe_files", _hashing_fails, 1)),
        "a path under a file": (root / "a_file", contextlib.nullcontext),
    }
    errors = {}
    for step, (case, (where, patch)) in enumerate(cases.items(), start=2):
        with patch():
            try:
                fxzero.save_checkpoint(where, model, opt, step=step)
                errors[case] = "no error"
            except Exception as err:  # noqa: BLE001 - the point: an Exception, which DCP's CheckpointException is not
                errors[case] = f"{type(err).__name__}: {err}"
    fxzero.save_checkpoint(root, model, opt, step=6)  # the ranks go on, in step
    return errors


def test_a_failed_save_raises_checkpoint_error_on_every_rank_and_removes_its_directory(tmp_path: Path) -> None:
    start = time.monotonic()
    results = run_ranks(2, _saves_that_fail, str(tmp_path), timeout=90)
    assert time.monotonic() - start < 60  # no rank waited for a process-group timeout
    expected = {
        "disk full on rank 1": (2, r"rank 1: OSError: \[Errno 28\] No space left on device: '.*step_0000002\.tmp-\w+'"),
        "read-only on rank 0": (3, r"rank 0: OSError: \[Errno 30\] Read-only file system: '.*step_0000003\.tmp-\w+'"),
        "hashing fails on rank 1": (4, r"rank 1: hashing the files failed: OSError: \[Errno 5\] Input/output error: 'a data file'"),
        "a path under a file": (5, r"NotADirectoryError: \[Errno 20\] Not a directory: '.*a_file/step_0000005\.tmp-\w+'"),
    }
    for rank, errors in enumerate(results):
        for case, (step, cause) in expected.items():
            where = tmp_path / "a_file" if step == 5 else tmp_path
            head = f"CheckpointError: saving checkpoint {where}/step_000000{step} failed (nothing committed; step_000000{step}.tmp-"
            assert errors[case].startswith(head), (rank, case, errors[case])
            assert re.search(cause, errors[case]), (rank, case, errors[case])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "step_0000001", "step_0000006"]
    assert fxzero.latest_checkpoint(tmp_path) == tmp_path / "step_0000006"


# ---- every rank makes the same call, or all that came fail within seconds -----------
def _save_on_rank_zero_only(ckpt_dir: str) -> dict[str, Any]:
    model, opt = _make("mlp", 2000)
    if dist.get_rank() == 1:
        return {"rank 1": "went on without saving"}
    start = time.monotonic()
    try:
        fxzero.save_checkpoint(ckpt_dir, model, opt, step=1, arrival_timeout=ARRIVAL)
    except fxzero.CheckpointError as err:
        return {"error": str(err), "seconds": time.monotonic() - start}
    return {"error": None}


@pytest.mark.job  # its own pool, and waits out the arrival timeout
def test_a_save_on_one_rank_only_fails_within_seconds_saying_every_rank_must_call_it(tmp_path: Path) -> None:
    """Its own pool: a rank that never came may still be blocked elsewhere."""
    with RankPool(2) as pool:
        results = pool.run(_save_on_rank_zero_only, str(tmp_path), timeout=60)
    assert results[1] == {"rank 1": "went on without saving"}
    assert results[0]["seconds"] < ARRIVAL + 3, results[0]
    assert results[0]["error"] == (
        f"save_checkpoint(step=1) on rank 0: rank(s) [1] of 2 did not call save_checkpoint/load_checkpoint within "
        f"{ARRIVAL:g} s. Both are collective: every rank must call them, at the same point of the program (a rank "
        "that does long work of its own first, such as an evaluation on rank 0 only, needs a larger arrival_timeout)"
    )
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def _call(fn: Callable[[], Any]) -> dict[str, Any]:
    start = time.monotonic()
    try:
        fn()
    except fxzero.CheckpointError as err:
        return {"error": str(err), "seconds": time.monotonic() - start}
    return {"error": None}


def _different_calls(ckpt_dir: str) -> list[dict[str, Any]]:
    model, opt = _make("mlp", 2000)
    fxzero.save_checkpoint(ckpt_dir, model, opt, step=1)
    rank = dist.get_rank()
    save = lambda step: lambda: fxzero.save_checkpoint(ckpt_dir, model, opt, step=step)  # noqa: E731
    load = lambda: fxzero.load_checkpoint(fxzero.latest_checkpoint(ckpt_dir), model, opt)  # noqa: E731
    results = [_call(save(2) if rank == 0 else load), _call(save(3) if rank == 0 else save(4))]
    return results + [_call(save(5)), _call(load)]  # the ranks still pair up, and the first call failed on all


def test_ranks_making_different_calls_all_fail_naming_each_call(tmp_path: Path) -> None:
    for rank, results in enumerate(run_ranks(2, _different_calls, str(tmp_path), timeout=90)):
        prefix = "save_checkpoint and load_checkpoint are collective: every rank of the optimizer's group must make the same call at the same point, but "
        assert results[0]["error"] == prefix + "rank 0 called save_checkpoint(step=2); rank 1 called load_checkpoint('step_0000001')"
        assert results[1]["error"] == prefix + "rank 0 called save_checkpoint(step=3); rank 1 called save_checkpoint(step=4)"
        assert max(r["seconds"] for r in results[:2]) < 5, results
        assert results[2:] == [{"error": None}, {"error": None}], (rank, results)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000001", "step_0000005"]


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), float("nan"), "30", True])
def test_a_bad_arrival_timeout_is_named(tmp_path: Path, timeout: Any) -> None:
    model, opt = _make("mlp", 2000)
    with pytest.raises(ValueError, match=r"arrival_timeout must be None or a finite number of seconds > 0, got "):
        fxzero.save_checkpoint(tmp_path, model, opt, step=1, arrival_timeout=timeout)
    with pytest.raises(ValueError, match=r"arrival_timeout must be None or a finite number of seconds > 0, got "):
        fxzero.load_checkpoint(tmp_path, model, opt, arrival_timeout=timeout)
    assert list(tmp_path.iterdir()) == []


def _late_rank_one(ckpt_dir: str) -> dict[str, Any]:
    """Rank 1 does work of its own first (a rank-0-style evaluation, here 1.5 s)."""
    from fxzero._torch_compat import process_group_timeout
    from fxzero.checkpoint import ranks

    model, opt = _make("mlp", 2000)
    if dist.get_rank() == 1:
        time.sleep(1.5)
    with mock.patch.object(ranks, "ARRIVAL_WARNING", 0.3), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fxzero.save_checkpoint(ckpt_dir, model, opt, step=1)  # the default arrival_timeout
    return {
        "warnings": [str(w.message) for w in caught if "has waited" in str(w.message)],
        "group timeout": process_group_timeout(None, opt.param_table.params[0].device),
    }


@pytest.mark.job  # waits for the late rank
def test_a_late_rank_is_waited_for_with_an_early_warning_naming_it(tmp_path: Path) -> None:
    """DDP and DCP wait for a late rank until the process group's timeout; so does the
    checkpoint handshake by default (saying early which rank it waits for)."""
    with RankPool(2, pg_timeout=45.0) as pool:  # its own group timeout, to see that it is the one used
        results = pool.run(_late_rank_one, str(tmp_path), timeout=60)
    assert results[0]["warnings"] == [
        "fxzero: save_checkpoint(step=1) on rank 0 has waited 0.3 s for rank(s) [1] of 2; it keeps waiting up to "
        "45 s (every rank must call it; pass arrival_timeout to fail sooner)"
    ]
    assert results[1]["warnings"] == [] and results[0]["group timeout"] == 45.0
    assert fxzero.checkpoint.ranks.ARRIVAL_WARNING == 30.0  # the README's "a warning after 30 s"
    assert (tmp_path / "step_0000001").is_dir()
