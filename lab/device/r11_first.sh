#!/usr/bin/env bash
# Session 11's first call, one H200, <= ~540 s: two jobs side by side on one GPU (neither is timed):
# 1. in the background, GLM nano's retrain alone (lab/device/r7_train.sh with FAMILIES=glm): the call
#    of both families earlier this session read GLM held-out tools 0.163 -> 0.263, arithmetic
#    0.023 -> 0.053, chat 0.33 -> 0.587 and Kimi chat 0.51 -> 0.377 (worse), but its 27.6 MB tarball
#    did not come back (16 MiB a file); $OUT/glm-5.2-nano.tar and $OUT/r7_train-logs.tar;
# 2. in the foreground, the GPU tests of the speculative paths merged this session (sampled steps on
#    one device graph; MTP KV catch-up) and of the reasoning guards inside the greedy graph.
#   run(command="bash lab/device/r11_first.sh", carry=[".whl"], timeout_s=600)
source "$(dirname "$0")/preamble.sh"
FAMILIES=glm TRAIN_MINUTES=${TRAIN_MINUTES:-3.6} MTP_END_S=${MTP_END_S:-455} EVAL_END_S=${EVAL_END_S:-530} NO_WHL=1 OUT=$OUT \
  bash lab/device/r7_train.sh > "$OUT/r7_train.stdout" 2>&1 &
train=$!
timeout 300 python3 -m pytest -p no:cacheprovider -p no:benchmark --tb=short --timeout 200 -rfE \
  tests/backend/engine/test_speculative_cuda.py tests/backend/engine/test_verify_graphs.py \
  tests/backend/engine/test_speculative_sampled.py tests/backend/engine/test_speculative_catch_up.py \
  tests/backend/engine/test_speculative_idle.py > "$OUT/pytest.log" 2>&1
echo "== GPU tests rc=$? at $(( $(date +%s) - START ))s"; grep -E "passed|failed|FAILED|^ERROR|^E " "$OUT/pytest.log" | tail -12
wait $train; echo "== retrain rc=$? at $(( $(date +%s) - START ))s"
grep -vE "step [0-9]+ |Writing model" "$OUT/r7_train.stdout" | tail -25
ls -la "$OUT"
