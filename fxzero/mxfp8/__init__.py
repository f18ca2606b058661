"""Public MXFP8 API: ``fxzero.mxfp8.quantize(x)`` / ``fxzero.mxfp8.dequantize(codes, scales)``."""
from .cast import BLOCK_SIZE, dequantize, quantize
__all__ = ["BLOCK_SIZE", "dequantize", "quantize"]
