"""Weight and KV-cache quantization: INT4 W4A16 (compressed-tensors `pack-quantized`), FP8 e4m3
weights (per output channel, or DeepSeek-style 128×128 blocks) and FP8 KV scales. Pure
`quantize_*`/`dequantize_*` functions live in `int4.py` and `fp8.py`, the scheme a checkpoint
declares in `scheme.py`, the modules holding packed buffers in `linear.py` and `experts.py`, the
walker that swaps a model's Linears in `walker.py`, the KV-cache scales in `kv_scales.py`. The
`kumo quantize` command that uses them is `backend.tools.quantize`."""
