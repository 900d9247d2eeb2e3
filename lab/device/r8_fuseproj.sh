#!/usr/bin/env bash
# Session 8 (issue 24, same-input Linears fused: backend/models/layers/fused.py), one H200, ≤ ~560 s:
# 1. the GPU tests the fusion touches: quantized decode vs its dequantized copy (fused stacks of INT4
#    and FP8 rows), the models' CUDA tests, decode graphs and speculative (MTP) steps on CUDA, and
#    the strided-row kernels the fused outputs now feed (RMSNorm, RoPE);
# 2. `kumo bench engine decode-c1` int4-all at 10 layers, after (fused, the default) and before
#    (--no-fuse-projections), then fp8 (block scales) after and before if time remains.
# Everything in $OUT/r8_fuseproj.tgz.
#   run(command="bash lab/device/r8_fuseproj.sh", carry=[".whl"], timeout_s=600)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r8fp && rm -rf $W && mkdir -p $W
LIMIT=${LIMIT:-560}
timeout 200 python3 -m pytest -p no:cacheprovider -p no:benchmark --tb=short --timeout 150 -rfE \
  tests/backend/quant/test_quant_decode_cuda.py tests/backend/models/test_models_cuda.py \
  tests/backend/engine/test_decode_graphs_cuda.py tests/backend/engine/test_speculative_cuda.py \
  tests/kernels/test_rms_norm.py tests/kernels/test_rope.py tests/backend/models/test_models_fused.py \
  > $W/pytest.log 2>&1
echo "== GPU tests rc=$? at $(el)s"; grep -E "passed|failed|FAILED|^ERROR|^E |Timeout" $W/pytest.log | tail -15
tar czf "$OUT/r8_fuseproj.tgz" -C $W .
c1() {  # c1 FORMAT SIDE BUDGET [ARGS...]: one decode-c1 record, skipped when the call has no time for it
  local fmt=$1 side=$2 budget=$3 left
  shift 3
  left=$(( LIMIT - $(el) - 30 ))
  [ "$budget" -gt "$left" ] && budget=$left
  if [ "$budget" -lt 60 ]; then echo "== decode-c1 $fmt $side: skipped (${left}s left)"; return; fi
  timeout $(( budget + 30 )) python3 -m benchmarks.cli engine decode-c1 --formats "$fmt" --rounds 3 \
    --budget-s "$budget" "$@" --out "$W/decode-c1-$fmt-$side.json" > "$W/decode-c1-$fmt-$side.log" 2>&1
  echo "== decode-c1 $fmt $side rc=$? at $(el)s"; grep -E "^\| $fmt " "$W/decode-c1-$fmt-$side.log"
  tar czf "$OUT/r8_fuseproj.tgz" -C $W .
}
c1 int4-all fused 90
c1 int4-all unfused 90 --no-fuse-projections
c1 fp8 fused 80
c1 fp8 unfused 80 --no-fuse-projections
echo "== done at $(el)s"
