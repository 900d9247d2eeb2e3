#!/usr/bin/env bash
# The next device session in three calls, each inside the 10-minute limit (device tool, `.whl` carried:
# msgspec, pytest-asyncio, llguidance, regex, tokenizers and transformers 5.24 wheels for cp312; never
# huggingface_hub 2.x, which needs httpx2, absent on the image):
#
#   run(command="bash benchmarks/device_plan.sh train",  carry=[".whl"])   # ~9.5 min
#   run(command="bash benchmarks/device_plan.sh sweeps", carry=[".whl"])   # ~8 min
#   (untar the two checkpoints into models/, commit)
#   run(command="bash benchmarks/device_plan.sh eval",   carry=[".whl"])   # ~6 min
#
# train: both nano models from scratch with the 2026-12-01 recipe (models/README.md), and meanwhile, on
#   the same GPU (the trainings use a few % of it; correctness only, no timing), every test the kernels
#   rewritten on 2026-12-01 have: the gpu-marked tests under tests/kernels and tests/backend, the
#   unmarked kernel tests on CUDA (they run on the GPU when there is one: the tampered-page and
#   later-slice cases are there), and benchmarks/kernels/gpu_review_checks.py.
# sweeps: the tile sweeps of MLA, W4A16, GQA/DSA and the fused MoE (old configuration beside the new).
# eval: the quality table (three variants) and GPU-vs-CPU agreement of the models in the tree.
# Only 8 files come back from $OUT: each stage packs its logs and records into $OUT/<stage>.tar
# (training: the two checkpoint tars beside it) and prints a summary. Keep the machine warm between
# calls (a fresh start costs a minute) and never give it back while calls remain: new loans can be
# paused for the rest of a session (2026-12-01).
set -uo pipefail
stage=${1:?train|sweeps|eval}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/$stage"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv,noheader
site() {  # the carried wheels on a fresh path (a warm machine keeps /tmp)
  rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
}
checks() {  # correctness of the GPU path, in order of what a failure would block
  local log=$OUT/train/checks.log
  timeout 250 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 200 -rfE tests/kernels tests/backend \
    > "$OUT/train/pytest_gpu.log" 2>&1
  timeout 150 python3 -m pytest -m "not gpu" -q -p no:cacheprovider --timeout 100 -rfE tests/kernels \
    > "$OUT/train/pytest_kernels_on_cuda.log" 2>&1
  timeout 120 python3 -m benchmarks.kernels.gpu_review_checks > "$OUT/train/review_checks.log" 2>&1
  for f in pytest_gpu pytest_kernels_on_cuda review_checks; do
    echo "== $f"; grep -E "passed|failed|^FAILED|^ERROR| FAIL |Timeout" "$OUT/train/$f.log" | tail -20
  done > "$log"
}
case $stage in
  train)
    (site; checks) &
    OUT="$OUT/train" TRAIN_ARGS="--prompt-weight 0.2 --profile-steps 3" bash models/recipes/run_on_device.sh 7.0
    wait
    cat "$OUT/train/checks.log"
    mv "$OUT"/train/*.tar "$OUT"/ 2>/dev/null
    ;;
  sweeps)
    site
    timeout 150 python3 -m benchmarks.kernels.bench_mla_decode --sweep --out "$OUT/sweeps/mla_sweep.json" 2>&1 \
      | grep -v Warning > "$OUT/sweeps/bench_mla_sweep.log"; tail -25 "$OUT/sweeps/bench_mla_sweep.log"
    timeout 65 python3 -m benchmarks.kernels.bench_w4a16 --quick --out "$OUT/sweeps/w4a16_quick.json" 2>&1 \
      | grep -v Warning > "$OUT/sweeps/bench_w4a16_quick.log"; tail -20 "$OUT/sweeps/bench_w4a16_quick.log"
    timeout 85 python3 -m benchmarks.kernels.bench_fused_moe --quick --out "$OUT/sweeps/fused_moe_quick.json" 2>&1 \
      | grep -v Warning > "$OUT/sweeps/bench_fused_moe_quick.log"; tail -16 "$OUT/sweeps/bench_fused_moe_quick.log"
    OUT="$OUT/sweeps" timeout 150 bash benchmarks/kernels/gqa_quick.sh
    ;;
  eval)
    OUT="$OUT/eval" timeout 540 bash models/recipes/eval_on_device.sh
    ;;
  *) echo "unknown stage $stage (train|sweeps|eval)"; exit 2 ;;
esac
rc=$?
tar -C "$OUT" -cf "$OUT/$stage.tar" "$stage" && rm -rf "${OUT:?}/$stage"
ls -la "$OUT"
exit $rc
