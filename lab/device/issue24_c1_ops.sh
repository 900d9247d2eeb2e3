#!/usr/bin/env bash
# Issue 24, c=1 decode (branch r3-c1): the fused RMSNorm / rotary / routing kernels, the DSA selection
# on the H200 — their tests (rope to the byte, the residual sum exact), the models on CUDA, then the
# c=1 profile to compare with /work/wt/decode_c1_profile.log (1,540 kernels, 5.46 ms device, p50 6.39).
#   run(command="bash lab/device/issue24_c1_ops.sh", carry=[".whl"])   # ~6 min
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_rms_norm.py tests/kernels/test_rope.py \
  tests/kernels/test_router.py tests/kernels/test_selection_triton.py tests/kernels/test_query_tiles.py \
  tests/kernels/test_dsa_indexer_triton.py tests/kernels/test_dsa_indexer_ref.py tests/backend/models/test_models_cuda.py \
  > "$OUT/tests.log" 2>&1
tail -5 "$OUT/tests.log"
timeout 300 python3 -m lab.diagnostics.decode_c1_profile --formats "${FORMATS:-int4-all,fp8}" --graphs 1 \
  --out "$OUT/decode_c1_profile.json" > "$OUT/decode_c1_profile.log" 2>&1
grep -v Warning "$OUT/decode_c1_profile.log" | grep -v "^USDT" | tail -70
