#!/usr/bin/env bash
# Session 9's first call, one H200, ≤ ~570 s: what went in on the CPU since the last GPU run.
# 1. GPU tests: the same-input fusion (on by default, backend/models/layers/fused.py) and the radix
#    selection (kernels/selection_triton.py) with the DSA indexer it feeds;
# 2. bench_selection (radix vs keys + torch.topk, alternating pairs);
# 3. `kumo bench engine decode-c1` int4-all at 10 layers: fused (the default) and --no-fuse-projections.
# Everything in $OUT/r9_first.tgz.
#   run(command="bash lab/device/r9_first.sh", carry=[".whl"], timeout_s=600)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r9f && rm -rf $W && mkdir -p $W
LIMIT=${LIMIT:-570}
pack() { tar czf "$OUT/r9_first.tgz" -C $W .; }
timeout 230 python3 -m pytest -p no:cacheprovider -p no:benchmark --tb=short --timeout 150 -rfE \
  tests/kernels/test_selection_triton.py tests/kernels/test_dsa_indexer_triton.py \
  tests/backend/quant/test_quant_decode_cuda.py tests/backend/models/test_models_cuda.py \
  tests/backend/engine/test_decode_graphs_cuda.py tests/backend/engine/test_speculative_cuda.py \
  tests/kernels/test_rms_norm.py tests/kernels/test_rope.py tests/backend/models/test_models_fused.py \
  > $W/pytest.log 2>&1
echo "== GPU tests rc=$? at $(el)s"; grep -E "passed|failed|FAILED|^ERROR|^E |Timeout" $W/pytest.log | tail -15
pack
timeout 90 python3 -m benchmarks.kernels.bench_selection --out $W/selection.json > $W/bench_selection.log 2>&1
echo "== bench_selection rc=$? at $(el)s"; grep -v Warning $W/bench_selection.log | tail -25
pack
c1() {  # c1 SIDE BUDGET [ARGS...]: one int4-all decode-c1 record, skipped when the call has no time for it
  local side=$1 budget=$2 left
  shift 2
  left=$(( LIMIT - $(el) - 40 ))
  [ "$budget" -gt "$left" ] && budget=$left
  if [ "$budget" -lt 60 ]; then echo "== decode-c1 $side: skipped (${left}s left)"; return; fi
  timeout $(( budget + 40 )) python3 -m benchmarks.cli engine decode-c1 --formats int4-all --rounds 3 \
    --budget-s "$budget" "$@" --out "$W/decode-c1-$side.json" > "$W/decode-c1-$side.log" 2>&1
  echo "== decode-c1 $side rc=$? at $(el)s"; grep -E "^\| int4-all " "$W/decode-c1-$side.log"
  pack
}
c1 fused 100
c1 unfused 100 --no-fuse-projections
echo "== done at $(el)s"
