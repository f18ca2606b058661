"""The text of a :class:`~fxzero.parity_check.report.ParityReport`.

Why a module of its own: :mod:`.report` decides what was found; this decides how a
user reads it, top to bottom: what ran, the loss per step on both sides, the params
that differ most (the first row is where to look), the noise floor and the
tolerances drawn from it, the two bitwise checks, and one verdict line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tabulate import tabulate

if TYPE_CHECKING:
    from .report import Agreement, ParamResult, ParityReport, Setup

__all__ = ["render"]

MAX_PARAM_ROWS = 12
_COMPILED = {"inductor": " compiled by plain Inductor"}


def _num(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def _header(report: "ParityReport") -> str:
    s, o = report.setup, report.setup.options
    bucket = {"auto": "auto", None: "none"}.get(o.bucket_size) or f"{o.bucket_size:,}"
    return (
        f"fxzero parity: {s.model}, {s.params} params ({s.elements:,} elements); {o.steps} steps of {s.optimizer}\n"
        f"fxzero: {o.world_size} gloo rank{'s' if o.world_size > 1 else ''} (CPU), inner compiler {o.inner_compiler}, "
        f"bucket size {bucket} ({s.buckets} bucket{'s' if s.buckets != 1 else ''}), "
        f"MXFP8 param gather {'on' if o.mxfp8 else 'off'}; reference: one process, eager, "
        + ("each rank's slice with that rank's generator (the model draws random numbers; the ranks' Inductor draws "
           "eager's)" if s.random else "global batch")
        + (f"\nprecision options: {', '.join(o.precision)} (the reference keeps fp32 state and masters)" if o.precision else "")
    )


def _table(rows: list, headers: tuple[str, ...], align: tuple[str, ...]) -> str:
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True, colalign=align)


def _bitwise(agreement: "Agreement", same: str) -> str:
    return same if agreement.identical else f"DIFFERS: {agreement.first_difference}"


def _loss_table(report: "ParityReport") -> str:
    tol = report.loss_tolerance.value
    rows = [
        (step + 1, f"{ref:.6f}", f"{fx:.6f}", _num(diff), _num(abs(fl - ref)), "yes" if diff <= tol else "NO")
        for step, (ref, fx, fl, diff) in enumerate(
            zip(report.reference_losses, report.fxzero_losses, report.floor_losses, report.loss_diffs)
        )
    ]
    headers = ("step", "reference loss", "fxzero loss", "abs diff", "noise floor", f"within {tol:.2e}")
    return _table(rows, headers, ("right",) * 5 + ("left",))


def _param_row(p: "ParamResult") -> tuple[str, ...]:
    bucket = "-" if p.bucket is None else str(p.bucket)
    over = "-" if p.first_exceeded is None else str(p.first_exceeded)
    return (p.name, "x".join(map(str, p.shape)) or "scalar", bucket, _num(p.diff), _num(p.floor), over)


def _param_table(report: "ParityReport") -> str:
    shown = report.params[:MAX_PARAM_ROWS]
    headers = ("param", "shape", "bucket", f"max abs diff after step {len(report.reference_losses)}", "noise floor",
               f"first step > {report.param_tolerance.value:.2e}")  # fmt: skip
    table = _table([_param_row(p) for p in shown], headers, ("left", "left") + ("right",) * 4)
    rest = len(report.params) - len(shown)
    order = "params over the tolerance first, earliest first; then by difference"
    return table + f"\n({order}" + (f"; {rest} more params, all within the tolerance)" if rest else ")")


def _floor_how(setup: "Setup") -> str:
    if setup.options.inner_compiler == "eager" and setup.random:
        return " through AOTAutograd (aot_eager, drawing the same masks)"
    return _COMPILED.get(setup.options.inner_compiler, "")


def _checks(report: "ParityReport") -> list[str]:
    s, tl, tp = report.setup, report.loss_tolerance, report.param_tolerance
    floor = (
        f"noise floor: the reference again{_floor_how(s)}, each gradient the mean of "
        f"{s.floor_parts} slices' backward passes (as the ranks compute it, without fxzero): "
        f"loss {_num(report.floor_loss)}, params {_num(report.floor_param)}"
        if s.floor_parts > 1
        else "noise floor: none (world size 1 and an odd batch: nothing to split)"
    )
    world = s.options.world_size
    return [
        floor,
        f"tolerances: loss {tl.value:.2e} ({tl.source}), params {tp.value:.2e} ({tp.source})",
        "overlap check (fxzero again with overlap_param_gather=False): "
        + _bitwise(report.overlap, "losses and params bitwise identical"),
        "ranks: " + _bitwise(report.ranks, f"params bitwise identical on all {world} ranks" if world > 1 else "one"),
        *(f"fxzero skipped the update at step {step} (non-finite gradient norm)" for step in report.skipped_steps),
        *([_drift(report)] if s.options.precision else []),
    ]


def _drift(report: "ParityReport") -> str:
    loss, param = max(report.loss_diffs, default=0.0), max((p.diff for p in report.params), default=0.0)
    return (
        f"drift against fp32 ({', '.join(report.setup.options.precision)}) over {len(report.loss_diffs)} steps: "
        f"loss {_num(loss)} ({_times(loss, report.floor_loss)} the noise floor), "
        f"params {_num(param)} ({_times(param, report.floor_param)} the noise floor)"
    )


def _times(value: float, floor: float) -> str:
    return f"{value / floor:.3g}x" if floor > 0 else ("1x" if value == 0 else "inf x")


def _verdict(report: "ParityReport") -> list[str]:
    verdict = report.verdict
    lines = [f"not comparable: {reason}" for reason in report.not_comparable]
    if not report.trained:
        why = "found before training; nothing was trained (see the fix above)"
    elif verdict == "PASS":
        why = "losses and every param within the tolerances, fxzero bitwise identical with itself"
    elif verdict == "NOT COMPARABLE":
        why = "no global-batch reference can match this model (see above); fxzero agrees with itself"
    else:
        why = "; ".join(report.failures)
    return lines + [f"verdict: {verdict}: {why} ({report.seconds:.1f} s)"]


def render(report: "ParityReport") -> str:
    if not report.trained:
        return "\n\n".join([_header(report), "\n".join(_verdict(report))]) + "\n"
    checks = "\n".join(_checks(report) + _verdict(report))
    sections = [_header(report), _loss_table(report), _param_table(report), checks]
    return "\n\n".join(sections) + "\n"
