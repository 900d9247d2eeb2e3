"""Weight and KV-cache quantization: INT4 W4A16 (compressed-tensors `pack-quantized`), FP8 e4m3
weights (per output channel, or DeepSeek-style 128×128 blocks), FP8 KV scales, and the `kumo
quantize` command. Pure `quantize_*`/`dequantize_*` functions live in `int4.py` and `fp8.py`; the
modules holding packed buffers and the walker that swaps a model's Linears live in `linear.py`."""
