"""Weight formats at the bottom layer: INT4 (compressed-tensors pack-quantized) and FP8 e4m3, each
implemented once and used by the kernels and `backend/quant` alike."""
