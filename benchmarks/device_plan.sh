#!/usr/bin/env bash
# The next device session in three calls, each well inside the 10-minute limit (device tool, `.whl`
# carried: msgspec, pytest-asyncio, llguidance, regex, tokenizers and transformers 5.24 wheels for
# cp312; never huggingface_hub 2.x, which needs httpx2):
#
#   run(command="bash benchmarks/device_plan.sh checks", carry=[".whl"])   # ~8.5 min
#   run(command="bash benchmarks/device_plan.sh train",  carry=[".whl"])   # ~9.5 min
#   run(command="bash benchmarks/device_plan.sh eval",   carry=[".whl"])   # ~8.5 min
#
# checks: every gpu-marked test under tests/kernels and tests/backend (the kernels rewritten on
#   2026-12-01 first run there: MLA decode/prefill, GQA decode/prefill, the DSA indexer, the INT4
#   GEMVs and fused MoE, the engine's staged host path), then the MLA tile sweep and the W4A16 sweep.
# train: both nano models from scratch with the 2026-12-01 recipe (models/README.md).
# eval: the quality table (three variants) and GPU-vs-CPU agreement of the models in the tree, then the
#   GQA/DSA and fused-MoE sweeps.
# Only 8 files come back from $OUT: each stage packs its logs and records into $OUT/<stage>.tar
# (training: the two checkpoint tars beside it) and prints a summary. Keep the machine warm between
# calls (a fresh start costs a minute): have the next command ready.
set -uo pipefail
stage=${1:?checks|train|eval}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/$stage"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv,noheader
site() {  # the carried wheels on a fresh path (a warm machine keeps /tmp)
  rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
}
case $stage in
  checks)
    site
    timeout 290 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 -rfE tests/kernels tests/backend \
      > "$OUT/checks/pytest_gpu_all.log" 2>&1
    grep -E "passed|failed|^FAILED|^ERROR" "$OUT/checks/pytest_gpu_all.log" | tail -30
    timeout 150 python3 -m benchmarks.kernels.bench_mla_decode --sweep --out "$OUT/checks/mla_sweep.json" 2>&1 \
      | grep -v Warning > "$OUT/checks/bench_mla_sweep.log"; tail -25 "$OUT/checks/bench_mla_sweep.log"
    timeout 65 python3 -m benchmarks.kernels.bench_w4a16 --quick --out "$OUT/checks/w4a16_quick.json" 2>&1 \
      | grep -v Warning > "$OUT/checks/bench_w4a16_quick.log"; tail -20 "$OUT/checks/bench_w4a16_quick.log"
    ;;
  train)
    # the kernels' gpu tests are not repeated here: a training shares the GPU with nothing else
    OUT="$OUT/train" TRAIN_ARGS="--prompt-weight 0.2 --profile-steps 3" bash models/recipes/run_on_device.sh 7.3
    mv "$OUT"/train/*.tar "$OUT"/ 2>/dev/null
    ;;
  eval)
    OUT="$OUT/eval" timeout 330 bash models/recipes/eval_on_device.sh
    site
    OUT="$OUT/eval" timeout 150 bash benchmarks/kernels/gqa_quick.sh
    timeout 85 python3 -m benchmarks.kernels.bench_fused_moe --quick --out "$OUT/eval/fused_moe_quick.json" 2>&1 \
      | grep -v Warning > "$OUT/eval/bench_fused_moe_quick.log"; tail -16 "$OUT/eval/bench_fused_moe_quick.log"
    ;;
  *) echo "unknown stage $stage (checks|train|eval)"; exit 2 ;;
esac
rc=$?
tar -C "$OUT" -cf "$OUT/$stage.tar" "$stage" && rm -rf "${OUT:?}/$stage"
ls -la "$OUT"
exit $rc
