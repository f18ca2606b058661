"""MXFP8 cast (fxzero.mxfp8): OCP MX v1.0 E4M3 blocks of 32 with E8M0 floor scales.

Error bound used below (derived from E4M3): let ``E = floor(log2 amax)`` of a block and
``s = 2^(E-8)`` its scale, so the scaled values ``y = x / s`` satisfy ``|y| < 512``.
E4M3 has 3 mantissa bits: in the binade [2^k, 2^(k+1)) (k >= -6) its spacing is 2^(k-3),
below 2^-6 (subnormals) it is 2^-9, and its largest value is 448. Round-to-nearest-even
is within half a spacing, so an element with ``|y| <= 448`` comes back within
``max(2^-4 * |x|, 2^(E-18))`` (relative 2^-4 for E4M3-normal values, plus the subnormal
floor ``s * 2^-10``). An element with ``|y| > 448`` (only possible when amax's mantissa is
above 1.75) saturates to ``±448 * s = ±1.75 * 2^E``. So per block
``max |x - deq(q(x))| <= max(2^(E-4), amax - 1.75 * 2^E) < 2^(E-2)``; the 2^(E-2) (not
2^(E-3)) comes from floor-mode saturation. This holds for blocks with ``amax >= 2^-118``
(scale byte >= 1); smaller blocks hit torchao's 2^-126 divisor (see
``test_tiny_blocks_use_the_2_pow_minus_126_divisor``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fxzero.mxfp8
from fxzero.mxfp8 import dequantize, quantize

NAN, INF = float("nan"), float("inf")


def block(*values: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One 32-element block: ``values`` followed by zeros."""
    x = torch.zeros(32, dtype=torch.float64)
    x[: len(values)] = torch.tensor(values, dtype=torch.float64)
    return x.to(dtype)


def u8(t: torch.Tensor) -> list[int]:
    return t.view(torch.uint8).reshape(-1).tolist()


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def random_blocks(seed: int, shape: tuple[int, ...], dtype: torch.dtype, lo: int = -150, hi: int = 127) -> torch.Tensor:
    """Normal values whose block magnitudes span 2^lo .. 2^hi, with a few outliers per block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(math.prod(shape) // 32, 32, generator=g, dtype=torch.float64)
    x *= torch.exp2(torch.randint(lo, hi, (x.shape[0], 1), generator=g).double())
    x *= torch.where(torch.rand(x.shape, generator=g) < 0.1, 2.0**-12, 1.0)  # tiny elements
    return x.clamp(-3e38, 3e38).to(dtype).reshape(shape)


# --- edge cases --------------------------------------------------------------------


def test_all_zero_block_gets_smallest_scale_and_zero_codes() -> None:
    codes, scales = quantize(torch.zeros(64))
    assert scales.dtype == torch.float8_e8m0fnu and u8(scales) == [0, 0]  # 2^-127
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (64,) and u8(codes) == [0] * 64
    assert torch.equal(dequantize(codes, scales), torch.zeros(64))


def test_negative_zero_keeps_its_sign() -> None:
    x = block(-0.0, 0.0, -0.0, 1.0)
    codes, scales = quantize(x)
    assert u8(codes)[:4] == [0x80, 0x00, 0x80, 0x78]  # 0x78 = 256 = 1.0 / 2^-8
    deq = dequantize(codes, scales)
    assert deq[:3].tolist() == [0.0, 0.0, 0.0] and deq[:3].signbit().tolist() == [True, False, True]
    codes, scales = quantize(torch.full((32,), -0.0))  # an all -0 block
    assert u8(scales) == [0] and u8(codes) == [0x80] * 32 and dequantize(codes, scales).signbit().all()


@pytest.mark.parametrize("e", [-100, -5, 0, 7, 110])
def test_exactly_448_times_a_power_of_two_is_exact(e: int) -> None:
    x = block(448.0, -448.0, 1.0, -0.5) * 2.0**e
    codes, scales = quantize(x)
    assert u8(scales) == [127 + e]  # floor(log2 448) - 8 = 0
    assert u8(codes)[:2] == [0x7E, 0xFE]  # ±448, the largest E4M3 normal
    assert torch.equal(dequantize(codes, scales), x)


def test_values_above_448_times_scale_saturate_instead_of_nan() -> None:
    # amax 1.99 -> E = 0, scale 2^-8: y = 509.4, 486.4 (would round to 512), 450.6 and 448 + 16 (tie)
    x = block(1.99, -1.9, 1.76, 464 / 256, 1.5)
    codes, scales = quantize(x)
    assert u8(scales) == [127 - 8]
    assert u8(codes)[:5] == [0x7E, 0xFE, 0x7E, 0x7E, 0x7C]  # 0x7C = 384 = 1.5 * 256
    deq = dequantize(codes, scales)
    assert deq[:5].tolist() == [1.75, -1.75, 1.75, 1.75, 1.5]
    assert not deq.isnan().any()
    # the saturation error exceeds 2^(E-3) but stays below 2^(E-2)
    assert 2.0**-3 < (x - deq).abs().max().item() < 2.0**-2


def test_nan_anywhere_in_a_block_gives_the_nan_scale() -> None:
    for pos in range(32):
        x = torch.cat([block(1.0, -2.0, 3.0), block(5.0, 6.0)])
        x[pos] = NAN
        codes, scales = quantize(x)
        assert u8(scales) == [255, 127 + 2 - 8]
        deq = dequantize(codes, scales)
        assert deq[:32].isnan().all() and torch.equal(deq[32:], block(5.0, 6.0))


def test_nan_wins_over_inf() -> None:
    codes, scales = quantize(block(INF, NAN, -INF))
    assert u8(scales) == [255] and dequantize(codes, scales).isnan().all()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_inf_block_follows_torchao_scale_2_pow_120(sign: float) -> None:
    # torchao (FLOOR): Inf's exponent field 255 - 127 - 8 = 120 -> scale byte 247, not NaN.
    # The Inf saturates to ±448, which dequantizes to ±448 * 2^120 = ±Inf in float32;
    # finite elements of the block flush to ±0 (anything below 2^110 here).
    x = block(sign * INF, 1e30, -3.0, 2.0**120)
    codes, scales = quantize(x)
    assert u8(scales) == [247]
    assert u8(codes)[:4] == [0x7E if sign > 0 else 0xFE, 0x00, 0x80, 0x38]
    deq = dequantize(codes, scales)
    assert deq[0].item() == sign * INF and deq[1:3].tolist() == [0.0, 0.0]
    assert deq[3].item() == 2.0**120 and not deq.isnan().any()


def test_huge_value_flushes_tiny_ones_toward_zero() -> None:
    e = 20  # amax = 2^20 -> scale s = 2^12; E4M3 subnormal step is s * 2^-9 = 2^3
    x = block(2.0**e, 1e-3, -1e-3, 8.0, 4.0, 6.0, 12.0, -2.0**e * 1.5)
    codes, scales = quantize(x)
    assert u8(scales) == [127 + e - 8]
    deq = dequantize(codes, scales)
    # 1e-3 -> ±0, 8 -> smallest subnormal, 4 (tie) -> 0 (even), 6 -> 8, 12 -> 16 (tie to even 2 * 8)
    assert deq[:8].tolist() == [2.0**e, 0.0, -0.0, 8.0, 0.0, 8.0, 16.0, -1.5 * 2.0**e]
    assert deq[2].signbit() and u8(codes)[3] == 0x01


def test_subnormal_inputs() -> None:
    # float32 subnormals: amax's exponent field is 0 -> scale byte 0, divisor 2^-126
    x = block(2.0**-130, -(2.0**-140), 2.0**-149, 3 * 2.0**-135)
    assert x[0] != 0 and x[2] != 0
    codes, scales = quantize(x)
    assert u8(scales) == [0]
    assert u8(codes)[:4] == [0x18, 0x80, 0x00, 0x03]  # 2^-4, -0 (2^-14 < 2^-10), 0, 3 * 2^-9
    deq = dequantize(codes, scales)
    assert deq[:4].tolist() == [2.0**-131, -0.0, 0.0, 3 * 2.0**-136]  # half of x: see below
    xb = block(2.0**-130, 2.0**-133, dtype=torch.bfloat16)  # bfloat16 subnormals behave the same
    assert u8(quantize(xb)[0])[:2] == [0x18, 0x04]


def test_tiny_blocks_use_the_2_pow_minus_126_divisor() -> None:
    # Scale byte 0 means 2^-127, but torchao divides by 2^-126 (float32's smallest normal),
    # so blocks with amax < 2^-118 dequantize to half their value. amax = 2^-118 is byte 1.
    x = block(1.5 * 2.0**-119, 2.0**-120)
    codes, scales = quantize(x)
    assert u8(scales) == [0] and u8(codes)[:2] == [0x74, 0x68]  # 192, 64 = x * 2^126
    assert torch.equal(dequantize(codes, scales), x / 2)
    x = block(2.0**-118, -(2.0**-121))
    codes, scales = quantize(x)
    assert u8(scales) == [1] and torch.equal(dequantize(codes, scales), x)


def test_float16_and_bfloat16_inputs_match_their_float32_cast() -> None:
    for dtype in (torch.float16, torch.bfloat16):
        x = random_blocks(3, (8, 64), torch.float32, lo=-14, hi=14).to(dtype)
        codes, scales = quantize(x)
        ref_codes, ref_scales = quantize(x.float())
        assert bits_equal(codes, ref_codes) and bits_equal(scales, ref_scales)
        assert dequantize(codes, scales, dtype).dtype == dtype


# --- error bound -------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shape", [(4096,), (64, 96), (3, 160)])
def test_round_trip_error_bound(seed: int, shape: tuple[int, ...]) -> None:
    x = random_blocks(seed, shape, torch.float32, lo=-110, hi=120)
    codes, scales = quantize(x)
    assert codes.shape == x.shape and scales.shape == (x.numel() // 32,)
    xb = x.double().reshape(-1, 32)
    err = (xb - dequantize(codes, scales, torch.float64).reshape(-1, 32)).abs()
    amax = xb.abs().amax(1, keepdim=True)
    e = torch.frexp(amax).exponent.double() - 1  # floor(log2 amax)
    assert torch.equal(scales.view(torch.uint8).reshape(-1, 1).double(), e - 8 + 127)
    y = xb / torch.exp2(e - 8)
    unsaturated = y.abs() <= 448
    elem_bound = torch.maximum(xb.abs() * 2.0**-4, torch.exp2(e - 18))
    assert (err <= elem_bound)[unsaturated].all()
    assert torch.equal(err[~unsaturated], (xb.abs() - 1.75 * torch.exp2(e).expand_as(xb))[~unsaturated])
    block_bound = torch.maximum(torch.exp2(e - 4), amax - 1.75 * torch.exp2(e))
    assert (err.amax(1, keepdim=True) <= block_bound).all() and (block_bound < torch.exp2(e - 2)).all()


# --- torchao reference -------------------------------------------------------------


def test_matches_torchao_to_mx_bit_for_bit() -> None:
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    for dtype in (torch.float32, torch.bfloat16):
        for seed in range(4):
            for shape in [(2048,), (32, 64), (16, 96)]:
                x = random_blocks(seed, shape, dtype)
                g = torch.Generator().manual_seed(seed)
                flat = x.view(-1)
                for value in (NAN, -NAN, INF, -INF, 0.0, -0.0, 448.0, 2.0**-133):
                    flat[torch.randint(0, flat.numel(), (3,), generator=g)] = value
                flat[:64] = 0.0  # two all-zero blocks
                codes, scales = quantize(x)
                ref_scales, ref_codes = to_mx(x, torch.float8_e4m3fn, 32)
                assert bits_equal(codes, ref_codes), (dtype, seed, shape)
                assert bits_equal(scales, ref_scales.reshape(-1)), (dtype, seed, shape)
                for out_dtype in (torch.float32, torch.bfloat16):
                    deq = dequantize(codes, scales, out_dtype)
                    ref = to_dtype(ref_codes, ref_scales, torch.float8_e4m3fn, 32, out_dtype)
                    assert torch.equal(deq.isnan(), ref.isnan())
                    assert bits_equal(deq.nan_to_num(), ref.nan_to_num()), (dtype, seed, shape, out_dtype)


# --- out= path ---------------------------------------------------------------------


def _out_views(numel: int, offset_blocks: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sentinel-filled flat buffers and views of a region in their middle."""
    nblocks = numel // 32
    codes_buf = torch.full((numel + 4 * 32 * offset_blocks,), 0x55, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales_buf = torch.full((nblocks + 4 * offset_blocks,), 0x55, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    start = 32 * offset_blocks
    return codes_buf, scales_buf, codes_buf[start : start + numel], scales_buf[offset_blocks : offset_blocks + nblocks]


def test_out_writes_into_the_given_views_and_returns_them() -> None:
    x = random_blocks(7, (12, 64), torch.float32)
    codes_buf, scales_buf, codes_view, scales_view = _out_views(x.numel())
    before_codes, before_scales = codes_buf.clone(), scales_buf.clone()
    codes, scales = quantize(x, out=(codes_view, scales_view))
    assert codes is codes_view and scales is scales_view
    assert codes.data_ptr() == codes_buf.data_ptr() + 64 and scales.data_ptr() == scales_buf.data_ptr() + 2
    ref_codes, ref_scales = quantize(x)
    assert bits_equal(codes, ref_codes.reshape(-1)) and bits_equal(scales, ref_scales)
    changed_codes = codes_buf.view(torch.uint8) != before_codes.view(torch.uint8)
    changed_scales = scales_buf.view(torch.uint8) != before_scales.view(torch.uint8)
    assert not changed_codes[:64].any() and not changed_codes[64 + x.numel() :].any()
    assert not changed_scales[:2].any() and not changed_scales[2 + x.numel() // 32 :].any()


class _AllocationLog(TorchDispatchMode):
    """Records every op output whose storage is new (aliases neither ``known`` nor an earlier output)."""

    def __init__(self, *known: torch.Tensor) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in known}
        self.fresh: list[tuple[str, torch.dtype, int]] = []
        self.alive: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        for t in tree_flatten(result)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.known:
                self.fresh.append((str(func), t.dtype, t.numel()))
                self.known.add(t.untyped_storage().data_ptr())  # later in-place ops alias it
                self.alive.append(t)  # no address reuse by a later temporary
        return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_path_allocates_no_output_and_one_documented_temporary(dtype: torch.dtype) -> None:
    x = random_blocks(8, (16, 128), dtype)
    codes_buf, scales_buf, codes_view, scales_view = _out_views(x.numel())
    with _AllocationLog(x, codes_buf, scales_buf) as log:
        quantize(x, out=(codes_view, scales_view))
    fp8 = (torch.float8_e4m3fn, torch.float8_e8m0fnu)
    assert [f for f in log.fresh if f[1] in fp8] == []
    big = [f for f in log.fresh if f[2] > x.numel() // 32]
    assert [(d, n) for _, d, n in big] == [(torch.float32, x.numel())]  # the scaled values


# --- errors and API ----------------------------------------------------------------


def test_numel_not_a_multiple_of_32_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="numel 33 is not a multiple of the block size 32"):
        quantize(torch.ones(33))
    with pytest.raises(ValueError, match="numel 48"):
        quantize(torch.ones(4, 12))
    with pytest.raises(ValueError, match="numel 40"):
        dequantize(torch.zeros(40, dtype=torch.float8_e4m3fn), torch.zeros(1, dtype=torch.float8_e8m0fnu))


def test_bad_out_dtypes_and_shapes_are_clear_errors() -> None:
    x = torch.randn(128)
    codes = torch.empty(128, dtype=torch.float8_e4m3fn)
    scales = torch.empty(4, dtype=torch.float8_e8m0fnu)
    with pytest.raises(TypeError, match="out must be .*got \\(torch.float8_e5m2, torch.float8_e8m0fnu\\)"):
        quantize(x, out=(torch.empty(128, dtype=torch.float8_e5m2), scales))
    with pytest.raises(TypeError, match="got \\(torch.float8_e4m3fn, torch.uint8\\)"):
        quantize(x, out=(codes, torch.empty(4, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="out codes must be a contiguous tensor of 128 elements.*shape \\(96,\\)"):
        quantize(x, out=(codes[:96], scales))
    with pytest.raises(ValueError, match="out scales must be a contiguous tensor of 4 elements.*shape \\(5,\\)"):
        quantize(x, out=(codes, torch.empty(5, dtype=torch.float8_e8m0fnu)))
    with pytest.raises(ValueError, match="contiguous=False"):
        quantize(x, out=(torch.empty(256, dtype=torch.float8_e4m3fn)[::2], scales))
    with pytest.raises(TypeError, match="x must be one of"):
        quantize(torch.ones(32, dtype=torch.int32))
    with pytest.raises(TypeError, match="float8_e4m3fn codes and float8_e8m0fnu scales"):
        dequantize(codes, scales.view(torch.uint8))
    with pytest.raises(ValueError, match="needs 4 scales, got 5"):
        dequantize(codes, torch.zeros(5, dtype=torch.float8_e8m0fnu))


def test_arguments_of_the_wrong_type_are_clear_errors() -> None:
    codes, scales = quantize(torch.randn(64))
    with pytest.raises(TypeError, match=r"dequantize: dtype must be a floating torch\.dtype \(e\.g\. torch\.float32\), got 'float32'"):
        dequantize(codes, scales, dtype="float32")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"dequantize: dtype must be a floating torch\.dtype .*got torch\.int32"):
        dequantize(codes, scales, dtype=torch.int32)
    with pytest.raises(TypeError, match="dequantize: codes must be a torch.Tensor, got str"):
        dequantize("codes", scales)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dequantize: scales must be a torch.Tensor, got list"):
        dequantize(codes, [1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="quantize: x must be a torch.Tensor, got list"):
        quantize([1.0] * 32)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"quantize: out must be a pair \(codes, scales\) of tensors, got Tensor"):
        quantize(torch.randn(64), out=codes)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="quantize: out scales must be a torch.Tensor, got NoneType"):
        quantize(torch.randn(64), out=(codes, None))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dequantize: codes are on meta but scales on cpu; use one device"):
        dequantize(codes.to("meta"), scales)
    assert torch.equal(dequantize(codes, scales, dtype=torch.float64), dequantize(codes, scales).double())


def test_out_views_may_have_any_shape_with_the_right_numel() -> None:
    x = random_blocks(9, (4, 64), torch.bfloat16)
    out = (torch.empty(2, 128, dtype=torch.float8_e4m3fn), torch.empty(8, dtype=torch.float8_e8m0fnu))
    codes, scales = quantize(x, out=out)
    assert codes.shape == (2, 128)
    assert torch.equal(dequantize(codes, scales).reshape(4, 64), dequantize(*quantize(x)))


def test_public_module_reexports_the_runtime_functions() -> None:
    import fxzero.mxfp8.cast as runtime

    assert fxzero.mxfp8.quantize is runtime.quantize and fxzero.mxfp8.dequantize is runtime.dequantize
    assert fxzero.mxfp8.BLOCK_SIZE == 32
