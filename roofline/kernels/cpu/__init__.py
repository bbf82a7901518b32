"""CPU kernels: fused dequantize-dot GEMMs over quantized weights (C, compiled at first use)."""
