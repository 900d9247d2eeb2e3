#!/usr/bin/env bash
# Session 13's launch fusions on the decode path (issue 24, branch r13-fuse), one H100 or H200, <= ~560 s,
# never run on a GPU: rope for up to four tensors (kernels/rope*.py), kv_write of two caches
# (kernels/kv_write*.py, KvLines), the LoRA norms + the indexer key's LayerNorm as one launch
# (kernels/row_norms*.py), the shared experts' add in the fused MoE's down epilogue (moe_gemv_finish ADD).
# 1. GPU tests of what changed (<= 240 s): every kernel against its reference on the GPU (bytes where the
#    tests say so), the models on CUDA against the CPU, decode with PDL on = off bit for bit, the PDL edges;
# 2. the rank-of-8 profile, PDL on: 2,521 kernels a step before (rank 0 of 8, 78 full DSA layers, 75 MoE
#    layers); expect 2,521 - 78 x 6 - 75 = 1,978, no vectorized_layer_norm and no CUDAFunctor_add<bf16> rows
#    but the one after the last layer, _rope_kernel / _kv_write_kernel / _row_norms_kernel 78 each,
#    _rms_norm_kernel 157 (the residual norms and the final norm);
# 3. `decode_c1_bytes_ratio_rank_of_8` int4-all, 3 rounds (session 13 before the fusions: 12.004 ms, 7.29x on
#    an H100): copy $W/decode-c1-rank-of-8.{json,md} to benchmarks/results/<date>-decode-c1-rank-of-8.*.
# Also: the resident-row DSA top-k (r13-radix) against the streamed kernel (`bench_selection --resident`,
# 1 x 2,176 is the decode row of the step; its tests and the speculative CUDA tests run in stage 1).
# Everything in $OUT/r13_fuse.tgz, packed after each stage.
#   run(command="timeout -s KILL 580 bash lab/device/r13_fuse.sh", carry=[".whl"], timeout_s=600)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r13f && rm -rf $W && mkdir -p $W
pack() { tar czf "$OUT/r13_fuse.tgz" -C $W .; }
LIMIT=${LIMIT:-560}  # a stage starts only if its timeout ends before LIMIT s
timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:benchmark --tb=short -rfE \
  tests/kernels/test_rope.py tests/kernels/test_row_norms.py tests/kernels/test_rms_norm.py \
  tests/kernels/test_kv_write_triton.py tests/kernels/test_fused_moe.py tests/kernels/test_fused_moe_fp8.py \
  tests/kernels/test_pdl.py tests/backend/models/test_models_cuda.py \
  tests/backend/engine/test_pdl_decode_cuda.py tests/backend/quant/test_quant_decode_cuda.py \
  tests/kernels/test_selection_triton.py tests/backend/engine/test_speculative_cuda.py > $W/pytest.log 2>&1
echo "== GPU tests rc=$? at $(el)s"; grep -E "passed|failed|FAILED|^ERROR|^E " $W/pytest.log | tail -10
pack
fits 60 "bench_selection" && timeout 60 python3 -m benchmarks.kernels.bench_selection --resident --out $W/resident.json > $W/resident.log 2>&1
echo "== bench_selection --resident rc=$? at $(el)s"; grep -v Warn $W/resident.log | tail -8
pack
fits 120 "decode-c1" && timeout 120 python3 -m benchmarks.cli engine decode-c1 --formats int4-all --rank-of 8 --rounds 3 --budget-s 80 \
  --out $W/decode-c1-rank-of-8.json > $W/decode-c1.log 2>&1
echo "== decode-c1 rank-of-8 rc=$? at $(el)s"; grep -E "^\`decode|^\| int4|PDL" $W/decode-c1.log | head -6
pack
fits 150 "profile" && timeout 150 python3 -m lab.diagnostics.decode_c1_profile --formats int4-all --layers 78 --rank-of 8 --steps 10 \
  --pdl on --top 30 --out $W/profile-rank-of-8.json > $W/profile-rank-of-8.log 2>&1
echo "== rank-of-8 profile rc=$? at $(el)s"; grep -v -E "Warning|warn|USDT|profiler" $W/profile-rank-of-8.log | head -34
pack
echo "== done at $(el)s"
