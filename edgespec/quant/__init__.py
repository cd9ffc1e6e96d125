"""Weight quantization: blockwise integer codes packed the way MatMulNBits reads them."""

from edgespec.quant.blockwise import QuantizedWeight, dequantize, quantize_blockwise

__all__ = ["QuantizedWeight", "dequantize", "quantize_blockwise"]
