"""MXFP8 quantize / dequantize (OCP Microscaling Formats v1.0, E4M3 elements).

A flat tensor is cut into blocks of 32 consecutive elements; each block stores 32
``float8_e4m3fn`` codes and one shared ``float8_e8m0fnu`` scale (a bare power of two,
exponent bias 127, byte 255 = NaN). Why these choices:

* **Scale** ``2^(floor(log2 amax) - 8)`` ("floor" mode): 8 is the exponent of E4M3's
  largest power of two (256), so the block max lands in [256, 512). It only reads the
  exponent bits of ``amax``, which is cheap and exact.
* **Rounding**: ``x / scale`` is exact in float32 (a power-of-two divide), and the cast
  to E4M3 rounds to nearest even once, so there is no double rounding.
* **Saturation**: a block max whose mantissa exceeds 1.75 maps above 448 (E4M3's max
  normal; E4M3 "fn" has no Inf), so scaled values are clamped to ±448 rather than
  overflowing to NaN. The price of floor mode is that clipping error (< 2^(e-2) for
  ``e = floor(log2 amax)``); non-clipped elements are within half an E4M3 ulp.

The output is bit-identical to torchao's reference cast in its default (FLOOR) mode,
``torchao.prototype.mx_formats.mx_tensor.to_mx(x, torch.float8_e4m3fn, 32)``, including
its edge cases, two of which differ from a literal reading of the format:

* a block with NaN gets the NaN scale (255), so it dequantizes to NaN; a block with
  ±Inf but no NaN gets scale 2^120 (Inf's exponent field minus 8), its Inf elements
  saturate to ±448 (which dequantizes to ±Inf in float32/bfloat16) and its finite
  elements flush to ±0;
* a block with ``amax < 2^-118`` (including all-zero and subnormal blocks) gets the
  smallest scale byte 0 (2^-127), but its elements are divided by 2^-126 (float32's
  smallest normal; torchao's guard against subnormal scales), so such a block
  dequantizes to half its value. Zero blocks are unaffected (codes stay ±0).

:func:`dequantize` is the plain format decode ``code * 2^(byte - 127)`` (NaN for byte
255), the same as torchao's ``to_dtype``.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["BLOCK_SIZE", "dequantize", "quantize"]

BLOCK_SIZE = 32
E4M3_MAX = 448.0
_E4M3_MAX_POW2 = 8  # 256 = largest power of two in float8_e4m3fn
_E8M0_NAN = 255
_F32_MIN_NORMAL = 2.0**-126
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def quantize(
    x: torch.Tensor, out: Optional[tuple[torch.Tensor, torch.Tensor]] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to MXFP8: returns ``(codes, scales)``.

    ``codes`` is ``float8_e4m3fn`` shaped like ``x``; ``scales`` is a 1-D
    ``float8_e8m0fnu`` tensor with ``x.numel() // 32`` entries, ``scales[i]`` covering
    elements ``32*i : 32*i + 32`` of ``x.reshape(-1)``. ``x`` (float32, bfloat16 or
    float16) must have a numel that is a multiple of 32.

    With ``out=(codes_out, scales_out)`` (contiguous tensors of those dtypes and
    numels, any shape, e.g. views of a preallocated flat buffer) the results are written
    into them and they are returned; no output tensor is allocated. Either way the
    temporaries are one float32 tensor of ``x.numel()`` elements (the scaled values,
    before the cast) and a few tensors of ``x.numel() // 32`` elements (block amax,
    exponents, NaN mask); plus a copy of ``x`` if ``x`` is not contiguous.
    """
    _check_tensor("quantize", "x", x)
    nblocks = _check_numel(x)
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"mxfp8.quantize: x must be one of {_INPUT_DTYPES}, got {x.dtype}")
    if out is None:
        codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        scales = torch.empty(nblocks, dtype=torch.float8_e8m0fnu, device=x.device)
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError(f"mxfp8.quantize: out must be a pair (codes, scales) of tensors, got {type(out).__name__}")
        codes, scales = out
        _check_tensor("quantize", "out codes", codes)
        _check_tensor("quantize", "out scales", scales)
        _check_out(x, codes, scales, nblocks)
    blocks = x.reshape(nblocks, BLOCK_SIZE)
    divisor = _write_scales(blocks, scales.view(torch.uint8).view(nblocks))
    scaled = torch.div(blocks, divisor.unsqueeze(1))  # exact: divisor is a power of two (or Inf)
    scaled.clamp_(-E4M3_MAX, E4M3_MAX)  # saturate; NaN stays NaN
    codes.view(nblocks, BLOCK_SIZE).copy_(scaled)  # round to nearest even
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode MXFP8 ``(codes, scales)`` to a new ``dtype`` tensor shaped like ``codes``.

    Each element is ``code * 2^(scale_byte - 127)``, computed exactly in float32 (float64
    for ``dtype=torch.float64``) and rounded once to ``dtype``; a NaN scale (byte 255)
    makes its whole block NaN.
    """
    _check_tensor("dequantize", "codes", codes)
    _check_tensor("dequantize", "scales", scales)
    if codes.dtype != torch.float8_e4m3fn or scales.dtype != torch.float8_e8m0fnu:
        raise TypeError(
            "mxfp8.dequantize: expected float8_e4m3fn codes and float8_e8m0fnu scales, "
            f"got {codes.dtype} and {scales.dtype}"
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"mxfp8.dequantize: dtype must be a floating torch.dtype (e.g. torch.float32), got {dtype!r}")
    nblocks = _check_numel(codes)
    if scales.numel() != nblocks:
        raise ValueError(
            f"mxfp8.dequantize: codes numel {codes.numel()} needs {nblocks} scales, got {scales.numel()}"
        )
    if scales.device != codes.device:
        raise ValueError(f"mxfp8.dequantize: codes are on {codes.device} but scales on {scales.device}; use one device")
    work = torch.promote_types(dtype, torch.float32)
    biased = scales.reshape(nblocks).view(torch.uint8)
    scale = torch.exp2(biased.to(work) - 127).masked_fill_(biased == _E8M0_NAN, float("nan"))
    values = codes.reshape(nblocks, BLOCK_SIZE).to(work).mul_(scale.unsqueeze(1))
    return values.reshape(codes.shape).to(dtype)


def _write_scales(blocks: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """Write each block's E8M0 scale byte into ``scale_bytes``; return the float32 divisors.

    byte = clamp(amax's float32 exponent field - 8, min=0), or 255 when amax is NaN. The
    divisor is that byte read as a float32 exponent field, i.e. 2^(byte - 127), except
    2^-126 for byte 0 and Inf for byte 255 (as torchao does).
    """
    amax = torch.linalg.vector_norm(blocks, float("inf"), dim=1).float()  # NaN-propagating max |x|
    biased = amax.view(torch.int32).bitwise_right_shift(23).bitwise_and_(0xFF)
    biased.sub_(_E4M3_MAX_POW2).clamp_(min=0).masked_fill_(amax.isnan(), _E8M0_NAN)
    scale_bytes.copy_(biased)
    return biased.bitwise_left_shift_(23).view(torch.float32).clamp_(min=_F32_MIN_NORMAL)


def _check_tensor(function: str, name: str, value: object) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"mxfp8.{function}: {name} must be a torch.Tensor, got {type(value).__name__}")


def _check_numel(t: torch.Tensor) -> int:
    if t.numel() % BLOCK_SIZE:
        raise ValueError(f"mxfp8: numel {t.numel()} is not a multiple of the block size {BLOCK_SIZE}")
    return t.numel() // BLOCK_SIZE


def _check_out(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, nblocks: int) -> None:
    if codes.dtype != torch.float8_e4m3fn or scales.dtype != torch.float8_e8m0fnu:
        raise TypeError(
            "mxfp8.quantize: out must be (float8_e4m3fn codes, float8_e8m0fnu scales), "
            f"got ({codes.dtype}, {scales.dtype})"
        )
    for name, t, numel in (("codes", codes, x.numel()), ("scales", scales, nblocks)):
        if t.numel() != numel or not t.is_contiguous() or t.device != x.device:
            raise ValueError(
                f"mxfp8.quantize: out {name} must be a contiguous tensor of {numel} elements on "
                f"{x.device}, got shape {tuple(t.shape)} (contiguous={t.is_contiguous()}) on {t.device}"
            )
