"""What Inductor's CPU loops vectorize, in the pinned torch: the facts the compiled update's layouts rest on.

``docs/precision.md`` ("Where the CPU stops") and :mod:`fxzero.optim.params.paired_words` explain
choices by two facts of Inductor's C++ code for the CPU:

* a loop that loads or stores int16 is not vectorized at all: why remainders and bf16 bits go
  through int32/int64 words;
* a loop that writes an fp32 tensor in place steps 16 lanes even where it also reads bf16, so its
  bf16 loads and stores are masked half-vectors: why two bf16 moment tensors are not the faster layout.

When a torch release changes one of them, its test here fails: the layouts are then worth measuring
again (``benchmarks/update_limits.py``).
"""

from __future__ import annotations

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
