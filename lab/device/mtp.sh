#!/usr/bin/env bash
# Issue 28's device calls (speculative decoding: verify/draft graphs, the mtp record), one stage a call,
# each inside the 10-minute limit; carry [".whl"] (the cp312 wheels of lab/device/device_plan.sh's header).
#   run(command="bash lab/device/mtp.sh checks", carry=[".whl"])  # ~3 min: the speculative gpu tests
#       (verify graphs captured and replayed, draft-depth graphs, greedy outputs = plain decoding's)
#   run(command="bash lab/device/mtp.sh bench", carry=[".whl"])   # ~8 min: benchmarks/results/<date>-mtp-gpu.json
# Look for: "passed" with no failure (a capture problem names itself in the assertion: `disabled_reason`);
# then the summary printed last: speedup_c1 per nano model and task (goal >= 1.3x), c64_on_over_off (goal
# >= 1.0x: the draft policy turns drafting down), projected speedup_c1 GLM 5.2 (goal >= 1.8x, a projection).
set -uo pipefail
stage=${1:?checks|bench}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv,noheader
rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
case $stage in
  checks)
    timeout 400 python3 -m pytest -m gpu -p no:cacheprovider -p no:benchmark --tb=short --timeout 300 -rfE \
      tests/backend/engine/test_speculative_cuda.py tests/backend/engine/test_decode_graphs_cuda.py \
      > "$OUT/pytest_gpu_mtp.log" 2>&1
    grep -E "passed|failed|FAILED|^ERROR|disabled|Timeout" "$OUT/pytest_gpu_mtp.log" | tail -25
    ;;
  bench)  # BUDGET (s, default 450)
    timeout $(( ${BUDGET:-450} + 90 )) python3 -m benchmarks.cli engine mtp --budget-s "${BUDGET:-450}" \
      --out "$OUT/mtp-gpu.json" > "$OUT/mtp-gpu.log" 2>&1
    grep -v Warning "$OUT/mtp-gpu.log" | tail -40
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
