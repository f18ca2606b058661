"""Reading Inductor's generated code: does any line touch a param before its gather wait?

The check works on the ``call`` function Inductor generates for a forward or inference
graph, and covers the copies Inductor makes itself (a channels-last copy of a conv
weight, any input transform): a copy reads the param, so its line names the param; if
that line comes before the wait, it is an early read; if the compiler hands the wait the
copy instead of the param, the wait names something that is not a graph input, and the
param is left uncovered. Both are reported.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["WaitCheck", "call_body", "check_waits"]

_WAIT = re.compile(r"torch\.ops\.fxzero\.wait_params\.default\(\[([^\]]*)\]\)")
# size and stride checks read no data: torch 2.15's Inductor puts an input's check (grouped when several inputs
# share it) just before its first kernel, which for a param is the gather wait
_NOT_A_READ = ("assert_size_stride(", "assert_size_stride_grouped(", "assert_alignment(", "del ", "return ")


@dataclasses.dataclass(frozen=True)
class WaitCheck:
    waited: frozenset[str]
    """Graph inputs some wait covers."""
    not_inputs: tuple[str, ...]
    """Names a wait received that are not graph inputs (a compiler's copy of a param)."""
    early: tuple[str, ...]
    """``name: line`` for every line that uses a waited input before its wait."""


def call_body(code: str) -> list[str]:
    """The lines of the generated ``call`` function, up to its return."""
    lines = code[code.index("def call(") :].splitlines()[1:]
    end = next(i for i, line in enumerate(lines) if line.strip().startswith("return "))
    return [line.strip() for line in lines[: end + 1]]


def _inputs(lines: list[str]) -> set[str]:
    unpack = next(line for line in lines if line.endswith("= args"))
    return {name.strip() for name in unpack[: -len("= args")].split(",") if name.strip()}


def check_waits(code: str) -> WaitCheck:
    lines = call_body(code)
    inputs = _inputs(lines)
    waited_at: dict[str, int] = {}
    for i, line in enumerate(lines):
        match = _WAIT.search(line)
        for name in match.group(1).split(", ") if match else ():
            waited_at.setdefault(name, i)
    early = []
    for i, line in enumerate(lines):
        if line.startswith(_NOT_A_READ) or line.endswith("= args") or _WAIT.search(line):
            continue
        early += [f"{name}: {line}" for name, at in waited_at.items() if i < at and re.search(rf"\b{name}\b", line)]
    return WaitCheck(frozenset(waited_at) & inputs, tuple(sorted(set(waited_at) - inputs)), tuple(early))
