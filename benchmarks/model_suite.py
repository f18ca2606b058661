"""A model suite nobody here wrote: PyTorch's own torch.compile benchmark lists, trained by
fxzero and by DDP + torch.compile, 3 steps each at world 2, compared step by step.

    python benchmarks/model_suite.py [--list hf|timm|all] [--only NAME ...] [--out FILE.md]
                                     [--jsonl FILE] [--resume] [--timeout SECONDS]

The models (:mod:`suite_models`) are every entry of ``benchmarks/dynamo/
huggingface_models_list_cpu.txt`` and ``timm_models_list.txt`` in pytorch/pytorch that the
pinned transformers and timm build, plus ``mixer_b16_224``, each from its config object and
shrunk to run on a 2-core CPU with every regularisation default kept (dropout, attention
dropout, drop-path, LayerDrop). Each model trains twice on 2 gloo ranks (:mod:`suite_ranks`):

* **fxzero**: ``DistributedOptimizer(params, torch.optim.SGD, lr=0.05, momentum=0.9,
  module=model)`` (buckets of a quarter of the model, so a tiny model still has several) +
  ``torch.compile(model, backend="fxzero")`` (Inductor inside);
* **reference**: ``torch.compile(DistributedDataParallel(model))`` (Inductor) +
  ``torch.optim.SGD`` with the same settings, with ``torch._dynamo.config.optimize_ddp =
  False``: with it on, DDPOptimizer splits the graph at DDP's bucket boundaries and every
  piece draws its own Inductor random seeds, so the dropout masks would differ from
  fxzero's one graph for reasons that are not fxzero's.

Both start from ``torch.manual_seed(0)``'s initial params, seed ``1234 + rank`` right before
the first step (each rank its own dropout masks, the same masks in both runs) and see the same
half of one fixed global batch of 4 each step. Dropout stays on, so a wrong mask, a gradient
in another param's slot or a stale param all show as differences far above rounding.

Classes: **pass**: per-rank losses within :data:`LOSS_TOL` at every step and final params
within :data:`PARAM_TOL` of the reference's (max over ranks); **mismatch**: either is
larger; **fxzero-error**: fxzero raised (or timed out) where the reference trained;
**both-fail**: both raised; **reference-error**: only the reference raised (listed: fxzero
is not at fault there); **skip**: the pinned library cannot build the model (the reason is
given). Every run is appended to ``--jsonl`` as it finishes; ``--resume`` skips the models
already there, so an interrupted run picks up where it stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

_HERE = Path(__file__).resolve().parent
for _path in (_HERE, _HERE.parent / "tests"):  # suite_models and suite_ranks, torchvision_compat: the ranks copy sys.path
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

import suite_models  # noqa: E402  (imports timm and transformers after the torchvision shim)
import suite_ranks  # noqa: E402
from fxzero.testing import RankError, RankPool, RankTimeout  # noqa: E402

__all__ = ["CLASSES", "LOSS_TOL", "PARAM_TOL", "Row", "Suite", "names", "run_model"]

LOSS_TOL = 1e-4
"""Per-step loss tolerance. Both runs compute the same fp32 math through Inductor graphs
that differ only by fxzero's collectives, so they agree to rounding: in the 2026-11-27 run
most models were bitwise equal and the largest difference was 5e-7 (losses of 2-40). A
wrong dropout mask is far above it: seeding fxzero's ranks differently moved BERT's
losses by 9e-3."""

PARAM_TOL = 1e-4
"""Final-param tolerance. SGD at lr 0.05 moves params by 1e-2 or more in 3 steps (the
``moved`` column); a gradient in the wrong slot or a stale param moves one by lr x gradient.
Rounding left at most 1.2e-7 in the 2026-11-27 run; different dropout masks, 9e-3 (BERT)."""

CLASSES = ("pass", "mismatch", "fxzero-error", "both-fail", "reference-error", "skip")
WORLD = 2


@dataclasses.dataclass
class Row:
    """One model's outcome: a table row and a jsonl line."""

    model: str
    family: str
    cls: str
    params: Optional[int] = None
    buckets: Optional[int] = None
    loss_diff: Optional[float] = None
    param_diff: Optional[float] = None
    moved: Optional[float] = None
    """The reference's largest param change over the run."""
    losses: Optional[list[float]] = None
    """The reference's losses on rank 0, step by step."""
    seconds: float = 0.0
    """Both runs, builds and compiles included, in the caller."""
    run_seconds: tuple[Optional[float], Optional[float]] = (None, None)
    """The reference's and fxzero's runs on rank 0 (jsonl only)."""
    note: str = ""
    shrink: str = ""
    trace: str = ""
    """The failing run's traceback tail (jsonl only)."""


Runner = Callable[..., list[Any]]
"""``run(fn, *args, timeout=...)`` on every rank: :meth:`fxzero.testing.RankPool.run`."""


class Suite:
    """A pool of ``WORLD`` ranks kept across models, restarted after a run that failed (a
    failed pool closes itself). Ranks get a long collective timeout: a rank still compiling
    a model while its peer waits in a collective is not a hang."""

    def __init__(self, pg_timeout: float = 900.0) -> None:
        self._pg_timeout = pg_timeout
        self._pool: Optional[RankPool] = None

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float) -> list[Any]:
        if self._pool is None or self._pool.closed:
            self._pool = RankPool(WORLD, pg_timeout=self._pg_timeout)
        return self._pool.run(fn, *args, timeout=timeout)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> "Suite":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def names(which: str) -> list[str]:
    """The models of ``--list``: ``hf``, ``timm`` (with ``mixer_b16_224``) or ``all``."""
    hf = list(suite_models.HF_LIST)
    timm = [n for n in suite_models.MODELS if n not in hf]
    return {"hf": hf, "timm": timm, "all": hf + timm}[which]


def _failure(err: BaseException) -> tuple[str, str]:
    """``(headline, traceback tail)`` of a failed run: the exception line of the first
    traceback in the harness's message (the first unindented line after "Traceback") and the
    30 lines before it, or, with no traceback (a timeout, a rank that died), its last line."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if line.startswith("Traceback")), None)
    end = None if start is None else next((i for i in range(start + 1, len(lines)) if not lines[i][0].isspace()), None)
    if end is None:
        return lines[-1][:300], "\n".join(lines[-30:])
    return lines[end][:300], "\n".join(lines[max(start, end - 30) : end + 3])


def _try(run: Runner, name: str, kind: str, timeout: float) -> tuple[Optional[list[dict]], str, str]:
    try:
        return run(suite_ranks.train, name, kind, timeout=timeout), "", ""
    except (RankError, RankTimeout) as err:
        return None, *_failure(err)


def _worst(diffs: Iterable[float]) -> float:
    """The largest difference, nan if any is (Python's ``max`` may skip a nan)."""
    return max(diffs, key=lambda d: math.inf if math.isnan(d) else d)


def _compare(row: Row, ref: list[dict], fx: list[dict]) -> None:
    """Fill in the diffs and the class; a mismatch's note names its first step and worst param."""
    loss_diffs = [max(abs(r["losses"][i] - f["losses"][i]) for r, f in zip(ref, fx)) for i in range(len(ref[0]["losses"]))]
    param_diffs = {k: max((f["params"][k] - r["params"][k]).abs().max().item() for r, f in zip(ref, fx)) for k in ref[0]["params"]}
    row.buckets, row.losses = fx[0]["buckets"], ref[0]["losses"]
    row.loss_diff, row.param_diff = _worst(loss_diffs), _worst(param_diffs.values())
    row.moved = max(r["moved"] for r in ref)
    if not all(math.isfinite(x) for r in ref for x in r["losses"]):
        row.cls, row.note = "mismatch", "the reference's loss is not finite"
    elif row.loss_diff <= LOSS_TOL and row.param_diff <= PARAM_TOL:
        row.cls = "pass"
    else:
        step = next((i + 1 for i, d in enumerate(loss_diffs) if not d <= LOSS_TOL), None)
        worst = max(param_diffs, key=lambda k: math.inf if math.isnan(param_diffs[k]) else param_diffs[k])
        row.cls, row.note = "mismatch", f"losses first differ at step {step}; largest param diff: {worst}"


def run_model(name: str, run: Runner, timeout: float = 1800.0) -> Row:
    """Build, train both ways and classify model ``name``; never raises for the model's sake."""
    if name in suite_models.SKIPS:
        return Row(name, "", "skip", note=suite_models.SKIPS[name])
    entry = suite_models.entry(name)
    row = Row(name, entry.family, "skip", shrink=entry.shrink)
    start = time.perf_counter()
    try:
        row.params = sum(p.numel() for p in suite_ranks.trainable(suite_ranks.build(name)))
    except Exception as err:  # noqa: BLE001 - the library cannot build it: the reason is the row
        row.note = f"cannot build: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        return row
    ref, ref_error, ref_trace = _try(run, name, "reference", timeout)
    fx, fx_error, fx_trace = _try(run, name, "fxzero", timeout)
    row.run_seconds = (ref and ref[0]["seconds"], fx and fx[0]["seconds"])
    if ref is not None and fx is not None:
        _compare(row, ref, fx)
    elif ref is not None:
        row.cls, row.note, row.trace = "fxzero-error", fx_error, fx_trace
    elif fx is not None:
        row.cls, row.note, row.trace = "reference-error", f"reference: {ref_error}", ref_trace
    else:
        row.cls, row.note = "both-fail", f"reference: {ref_error}; fxzero: {fx_error}"
        row.trace = f"--- reference ---\n{ref_trace}\n--- fxzero ---\n{fx_trace}"
    if row.cls != "pass" and entry.known:
        row.note = f"{entry.known}: {row.note}"
    row.seconds = time.perf_counter() - start
    return row


def _fmt(x: Optional[float]) -> str:
    return "" if x is None else f"{x:.1e}"


def _losses(losses: Optional[list[float]]) -> str:
    return "" if not losses else f"{losses[0]:.3g}→{losses[-1]:.3g}"


def table(rows: list[Row]) -> str:
    """The markdown table, the count of each class, the long notes as footnotes, and the
    shrinks in a table of their own (long cells would pad every row of the first)."""
    notes: list[str] = []

    def note(text: str) -> str:
        if len(text) <= 40:
            return text
        notes.append(text)
        return f"[{len(notes)}]"

    body = [[r.model, r.family, "" if r.params is None else f"{r.params:,}", "" if r.buckets is None else r.buckets,
             _fmt(r.loss_diff), _fmt(r.param_diff), _fmt(r.moved), _losses(r.losses), r.cls, f"{r.seconds:.0f}", note(r.note)]
            for r in rows]  # fmt: skip
    headers = ["model", "family", "params", "buckets", "max loss diff", "max param diff", "moved", "loss 1→3", "class", "s", "note"]
    counts = ", ".join(f"{c} {sum(r.cls == c for r in rows)}" for c in CLASSES)
    footnotes = "".join(f"\n[{i}] {text}\n" for i, text in enumerate(notes, 1))
    shrinks = tabulate([[r.model, r.shrink] for r in rows], headers=["model", "shrink"], tablefmt="github")
    return (tabulate(body, headers=headers, tablefmt="github", disable_numparse=True) + f"\n\n{len(rows)} models: {counts}\n"
            + footnotes + "\n" + shrinks + "\n")  # fmt: skip


def _header(argv: list[str]) -> str:
    import timm
    import transformers

    return (
        f"# fxzero model suite, {datetime.date.today().isoformat()}\n\n"
        f"torch {torch.__version__}, transformers {transformers.__version__}, timm {timm.__version__}; "
        f"{os.cpu_count()}-core {platform.machine()} CPU, no GPU; world {WORLD} gloo ranks of 1 thread each on that machine, "
        f"Inductor (cold cache at the start: a model's compile reuses kernels of the models before it).\n\n"
        f"Command: `python {' '.join(argv)}`\n\n"
        f"Each model trains {suite_ranks.STEPS} steps (SGD lr {suite_ranks.SGD['lr']}, momentum {suite_ranks.SGD['momentum']}, "
        f"global batch {suite_ranks.GLOBAL}) with fxzero and with DDP + torch.compile (optimize_ddp off); pass: "
        f"loss diff <= {LOSS_TOL:g} and param diff <= {PARAM_TOL:g} (max over steps and ranks); moved: the reference's "
        f"largest param change (1 or more in the BatchNorm convnets: BatchNorm over 2 examples a rank lets SGD at this lr blow "
        f"the first convs' weights up, in eager PyTorch too; both runs still agree); s: both runs, compiles included. "
        f"`benchmarks/model_suite.py`'s docstring has the details.\n\n"
    )


def _load(path: Optional[Path]) -> dict[str, Row]:
    if path is None or not path.exists():
        return {}
    rows = [Row(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    return {r.model: r for r in rows}


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", choices=("hf", "timm", "all"), default="all", help="which list (timm includes mixer_b16_224)")
    p.add_argument("--only", nargs="+", metavar="NAME", help="these models only (names as in PyTorch's lists, or a test's tiny-*)")
    p.add_argument("--out", type=Path, help="write the table (with a header) to this markdown file")
    p.add_argument("--jsonl", type=Path, help="append each model's row to this file as it finishes")
    p.add_argument("--resume", action="store_true", help="skip models already in --jsonl (their rows still print)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run (each model runs twice)")
    args = p.parse_args(argv)
    selected = args.only or names(args.list)
    known = {**suite_models.MODELS, **suite_models.TINY, **suite_models.SKIPS}
    unknown = [n for n in selected if n not in known]
    if unknown:
        p.error(f"unknown models {unknown}; known: {sorted(known)}")
    done = _load(args.jsonl) if args.resume else {}
    rows = []
    with Suite() as suite:
        for name in selected:
            row = done.get(name) or run_model(name, suite.run, args.timeout)
            if name not in done and args.jsonl:
                with args.jsonl.open("a") as f:
                    f.write(json.dumps(dataclasses.asdict(row)) + "\n")
            print(f"{row.model}: {row.cls} loss {_fmt(row.loss_diff)} params {_fmt(row.param_diff)} {row.seconds:.0f}s {row.note}",
                  flush=True)  # fmt: skip
            rows.append(row)
    text = table(rows)
    print("\n" + text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(_header(["benchmarks/model_suite.py", *(argv if argv is not None else sys.argv[1:])]) + text)


if __name__ == "__main__":
    main()
