"""What Inductor's CPU loops vectorize, in the pinned torch: the facts the compiled update's layouts rest on.

``docs/precision.md`` ("Where the CPU stops") and :mod:`fxzero.optim.params.paired_words` explain
choices by two facts of Inductor's C++ code for the CPU:

* a loop that loads or stores int16 is not vectorized at all: why remainders and bf16 bits go
  through int32/int64 words;
* a loop that writes an fp32 tensor in place steps 16 lanes even where it also reads bf16, so its
  bf16 loads and stores are masked half-vectors: why two bf16 moment tensors are not the faster layout;
* a reduction over each row whose results also leave as a per-row output is not fused with the loop
  that writes the rows under one loop over rows: why the fp8 update (whose blocks' scales are such an
  output) reads its run from memory twice, once for the block maxima and once to write.

When a torch release changes one of them, its test here fails: the layouts are then worth measuring
again (``benchmarks/update_limits.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code


def _generated(fn, *args) -> str:
    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(fn, dynamic=True, fullgraph=True), *args)
    return "\n".join(code)


def test_a_loop_over_int16_is_not_vectorized():
    code = _generated(lambda a: a + 1, torch.zeros(4096, dtype=torch.int16))
    assert "kernel" in code and "Vectorized" not in code


def test_a_loop_writing_fp32_in_place_reads_bf16_in_masked_half_vectors():
    def step(master: torch.Tensor, m: torch.Tensor) -> None:
        new = m.float() * 0.9 + master
        m.copy_(new)
        master.copy_(new * 2)

    code = _generated(step, torch.randn(4096), torch.zeros(4096, dtype=torch.bfloat16))
    assert "at::vec::Vectorized<at::BFloat16>::loadu" in code
    assert "x0+=static_cast<int64_t>(16L)" in code and "x0+=static_cast<int64_t>(32L)" not in code


def _rows_kernel(fn, *args) -> str:
    """The C++ kernel :func:`_generated` makes of ``fn`` over rows of a constant length."""
    for t in args:
        if t.dim() == 2:
            torch._dynamo.mark_static(t, 1)  # a block's length is a constant of the graph, as in fused_run._rows
    text = _generated(fn, *args)
    start = text.index('extern "C"')
    return text[start : text.index("'" * 3, start)]


@pytest.mark.slow
def test_row_maxima_kept_per_row_split_the_loop_over_rows():
    def scaled(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x / x.amax(dim=1).unsqueeze(1))

    def scaled_keeping_maxima(x: torch.Tensor, out: torch.Tensor, maxima: torch.Tensor) -> None:
        largest = x.amax(dim=1)
        maxima.copy_(largest * 2)
        out.copy_(x / largest.unsqueeze(1))

    x, out = torch.rand(4096, 32) + 0.1, torch.empty(4096, 32)
    assert _rows_kernel(scaled, x, out).count("for(int64_t x0=") == 1  # one loop over rows: reduce, then write the row
    assert _rows_kernel(scaled_keeping_maxima, x, out, torch.empty(4096)).count("for(int64_t x0=") > 1
