"""Where the compiled narrow-state update stops on this CPU, and why: Inductor's CPU code, measured.

``benchmarks/update.py`` measures ``step()`` per precision mode; this script takes the compiled run
update apart, on one thread over one run of 5.24M elements, every row paired in the same rounds
(median), so the reasons the bf16 and fp8 targets of issue 54 are not met are numbers, not guesses:

* **bf16 state** (``PairHalf``: both moments in one int32 word per element). Its row against three
  variants of the same loop (wrong values): value conversions where it bit-casts
  (Inductor writes each bit cast as a scalar loop over a stored vector, ``tmpbuf``: does it cost
  anything?), its bytes with nothing packed (an fp32 tensor in place of the words: what the packing
  arithmetic costs), and fp32 moments (8 more bytes per element). And the layout without packing: two bf16
  tensors. Inductor steps 16 lanes in a loop that writes the fp32 master in place, so their loads
  and stores are masked half-vectors (``tests/test_inductor_cpu_code.py``), slower than the packing.
* **fp8 state**: the update over rows of one block (``fused_run._in_rows``) and over the flat run, as
  before. Row "decode, update and block maxima only" is one read pass that decodes both
  moments, updates them and takes each block's maximum, writing 8 bytes per 32 elements. Any fp8
  update needs at least that pass; on this machine it alone takes longer than the bandwidth bound
  of the whole update.
* **The global norm** that ``step()`` measures before the update (it reports it, clips by it and skips a
  non-finite step on it): one more read of the gradients.

    python benchmarks/update_limits.py [--rounds 15] [--numel 5242880]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from fxzero._torch_compat import foreach_norm
from fxzero.inductor_function import Compiling, shared
from fxzero.optim.params.bf16_rounding import nearest_even_bits
from fxzero.optim.update import fused_run
from fxzero.optim.update.fused_run import FusedRunUpdate
from fxzero.optim.update.moment_store import BLOCK, HIGH_HALF, BlockStore, RootStore, make_stores

HYPER = (1e-3, 0.9, 0.999, 1e-8, 0.01, False, True)
"""lr, beta1, beta2, eps, weight decay, maximize, decoupled (AdamW)."""


def _adam(master: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, scalars: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``fused_run._adam_run``'s arithmetic on fp32 values (AdamW, no maximize)."""
    one_minus_beta1, beta2, one_minus_beta2, eps, _, decay_factor, step_size, inverse_bias_correction2_sqrt = scalars.unbind()
    m = m.lerp(g, one_minus_beta1)
    v = v * beta2 + one_minus_beta2 * g * g
    return master * decay_factor - step_size * m / (v.sqrt() * inverse_bias_correction2_sqrt + eps), m, v


def _pair_without_casts(master: torch.Tensor, grad: torch.Tensor, words: torch.Tensor, scalars: torch.Tensor) -> None:
    """The bf16 pair pass with value conversions where it has bit casts (wrong values, the same integer work)."""
    new, m, v = _adam(master, grad, (words & HIGH_HALF).float(), (words << 16).float(), scalars)
    words.copy_(nearest_even_bits(m.to(torch.int32)) | ((nearest_even_bits(v.to(torch.int32)) >> 16) & 0xFFFF))
    master.copy_(new)


def _pair_bytes_only(master: torch.Tensor, grad: torch.Tensor, words: torch.Tensor, scalars: torch.Tensor) -> None:
    """The bf16 pair pass's bytes (one fp32 tensor for the words: normal numbers, as a denormal would
    stall the loop) and Adam's arithmetic, nothing packed (wrong values)."""
    new, m, v = _adam(master, grad, words, words * 0.5, scalars)
    words.copy_(m + v)
    master.copy_(new)


def _two_bf16(master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, scalars: torch.Tensor) -> None:
    new, m_new, v_new = _adam(master, grad, m.float(), v.float(), scalars)
    m.copy_(m_new)
    v.copy_(v_new)
    master.copy_(new)


def _fp32_moments(master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, scalars: torch.Tensor) -> None:
    new, m_new, v_new = _adam(master, grad, m, v, scalars)
    m.copy_(m_new)
    v.copy_(v_new)
    master.copy_(new)


def _fp8_floor(grad: torch.Tensor, m_codes: torch.Tensor, m_exponents: torch.Tensor, v_codes: torch.Tensor, v_scales: torch.Tensor,
               scalars: torch.Tensor, maxima: torch.Tensor) -> None:  # fmt: skip
    """Decode both fp8 moments, update them and take each block's largest |m| and root: no other write."""
    blocks = m_exponents.numel()
    g = grad.view(blocks, BLOCK)
    _, m, v = _adam(g, g, BlockStore.decode(m_codes.view(blocks, BLOCK), m_exponents), RootStore.decode(v_codes.view(blocks, BLOCK), v_scales), scalars)
    maxima[0].copy_(m.abs().amax(dim=1))
    maxima[1].copy_(v.sqrt().amax(dim=1))


def _flat(update: FusedRunUpdate, *args: object) -> None:
    """``update`` over the flat run, as before runs of whole blocks stepped as rows (``fused_run._in_rows``)."""
    in_rows = fused_run._in_rows
    fused_run._in_rows = lambda kinds, grad: False
    try:
        update(*args)
    finally:
        fused_run._in_rows = in_rows


def _bandwidth(a: torch.Tensor, b: torch.Tensor) -> float:
    """Bytes per second of ``a.add_(b)`` (two reads and a write per element)."""
    start = time.perf_counter()
    a.add_(b)
    return 3 * a.nbytes / (time.perf_counter() - start)


def _rows(n: int) -> tuple[dict[str, Callable[[], object]], dict[str, float]]:
    """Each measured call, and the bytes per element its bound counts (0: not a bound row)."""
    torch.manual_seed(0)
    master, grad = torch.randn(n), torch.randn(n) * 1e-2
    scalars = torch.tensor((1 - 0.9, 0.999, 1 - 0.999, 1e-8, 0.01, 1 - 1e-3 * 0.01, 1e-3, 1.0))  # as FusedRunUpdate makes them
    update = FusedRunUpdate(Compiling(True, "the run update"))  # required: a row that fell back would time the eager ops
    pair = make_stores(("bf16", "bf16"), n, master.device, paired=True)
    fp8 = make_stores(("fp8", "fp8"), n, master.device, paired=True)
    fp8_flat = make_stores(("fp8", "fp8"), n, master.device, paired=True)
    bf16_m, bf16_v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    fp32_m, fp32_v = torch.zeros(n), torch.zeros(n)
    plain = torch.rand(n) + 0.5
    maxima = torch.zeros(2, n // BLOCK)
    adam = torch.optim.AdamW([torch.nn.Parameter(torch.randn(n))], lr=1e-3, weight_decay=0.01, fused=True)
    adam.param_groups[0]["params"][0].grad = grad
    calls: dict[str, Callable[[], object]] = {
        "torch fused AdamW, fp32 state": adam.step,
        "fxzero bf16 pair pass (compiled_update)": lambda: update(master, grad, *pair, 5, HYPER),
        "  the same, value conversions for its bit casts": lambda: shared(_pair_without_casts, 1)(master, grad, pair[0].words, scalars),
        "  its bytes and Adam's arithmetic, nothing packed": lambda: shared(_pair_bytes_only, 1)(master, grad, plain, scalars),
        "  two bf16 tensors instead (16 lanes, masked)": lambda: shared(_two_bf16, 1)(master, grad, bf16_m, bf16_v, scalars),
        "  fp32 moments, the same pass": lambda: shared(_fp32_moments, 1)(master, grad, fp32_m, fp32_v, scalars),
        "fxzero fp8 run pass (compiled_update)": lambda: update(master, grad, *fp8, 5, HYPER),
        "  the same over the flat run (before rows)": lambda: _flat(update, master, grad, *fp8_flat, 5, HYPER),
        "  fp8 decode, update and block maxima only": lambda: shared(_fp8_floor, 1)(grad, fp8[0].codes, fp8[0].scales, fp8[1].codes,
                                                                                      fp8[1].scales, scalars, maxima),
        "global grad norm (torch._foreach_norm)": lambda: foreach_norm([grad]),
    }  # fmt: skip
    fp8_bytes = 4 + 8 + (1 + 1 / 32) * 2 + (1 + 2 / 32) * 2
    bound = {"torch fused AdamW, fp32 state": 28.0, "fxzero bf16 pair pass (compiled_update)": 20.0,
             "fxzero fp8 run pass (compiled_update)": fp8_bytes, "global grad norm (torch._foreach_norm)": 4.0}  # fmt: skip
    return calls, bound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--numel", type=int, default=5 << 20, help="elements of the run (a multiple of 64)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    calls, bound = _rows(args.numel)
    a, b = torch.ones(16 << 20), torch.ones(16 << 20)
    times: dict[str, list[float]] = {label: [] for label in calls}
    bandwidth = []
    for r in range(args.rounds + 1):  # round 0 compiles
        for label, call in (calls.items() if r % 2 else reversed(calls.items())):
            start = time.perf_counter()
            call()
            if r:
                times[label].append(time.perf_counter() - start)
        bandwidth.append(_bandwidth(a, b))
    bw = statistics.median(bandwidth)
    ms = {label: 1e3 * statistics.median(t) for label, t in times.items()}
    print(f"{args.numel} elements, 1 thread, median of {args.rounds} paired rounds; torch.add_ {bw / 1e9:.1f} GB/s\n")
    print("| pass | ms | bound bytes / element | bound ms | x bound |\n|---|---|---|---|---|")
    for label, t in ms.items():
        bound_ms = 1e3 * bound[label] * args.numel / bw if label in bound else None
        cells = (f"{bound[label]:.2f}", f"{bound_ms:.2f}", f"{t / bound_ms:.2f}") if bound_ms else ("", "", "")
        print(f"| {label} | {t:.2f} | " + " | ".join(cells) + " |")
    norm = ms["global grad norm (torch._foreach_norm)"]
    for mode in ("fxzero bf16 pair pass (compiled_update)", "fxzero fp8 run pass (compiled_update)"):
        limit = 1.5e3 * bound[mode] * args.numel / bw
        print(f"\n{mode.split(' (')[0]}: 1.5x its bound is {limit:.2f} ms; the norm alone takes {norm:.2f} ms of it, "
              f"leaving {limit - norm:.2f} ms for a pass that takes {ms[mode]:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
