#!/usr/bin/env bash
# The last device call of round 2's third session (~7.5 min; carry [".whl", ".mtp-init"]):
#   run(command="bash lab/device/r4_final.sh", carry=[".whl", ".mtp-init"])
# 1. the MTP layer of each retrained nano model (models/recipes/train_mtp.py, now on CUDA), both at once,
#    from the committed layer (.mtp-init/<name>/mtp.safetensors: the layers of the replaced checkpoints),
#    installed into models/<name> and packed as $OUT/<name>.tar;
# 2. beside them, the GPU tests of this session's changes: the verify/draft graphs' owned index tensors
#    (test_speculative_cuda, its replay test no longer skipped), the DSA dense-context decode graphs
#    (test_decode_graphs_cuda), MLA decode (sparse with every key) and the indexer;
# 3. after 1, with the time left: `kumo bench engine mtp` (speedup_c1 / c64 on the nano models, the
#    GLM 5.2 projection) -> $OUT/mtp-gpu.json.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$(date +%s)
END_S=${END_S:-520}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv,noheader
rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
MIX=gsm-nano=0.22,tool-call=0.24,chat=0.14,arc-nano-easy=0.08,arc-nano-challenge=0.06,mmlu-nano=0.08
mtp() {  # mtp <family>
  local fam=$1 name
  name=$([ "$fam" = kimi ] && echo kimi-k2.6-nano || echo glm-5.2-nano)
  python3 -m models.recipes.build --out "/tmp/m-$fam" --family "$fam" --train-items "${MTP_ITEMS:-60000}" \
    --test-items 10 --first-item 900000 --mixture "$MIX" || return 4
  timeout 300 python3 -m models.recipes.train_mtp --family "$fam" --data "/tmp/m-$fam" --checkpoint "models/$name" \
    --out "/tmp/mo-$fam" --init ".mtp-init/$name" --minutes "${MTP_MINUTES:-2.5}" --max-items "${MTP_ITEMS:-60000}" \
    --batch-tokens 65536 --lr 1e-3 --warmup 20 --workers 6 || return 5
  python3 -c "import sys; from pathlib import Path; from models.recipes.train_mtp import install; install(Path(sys.argv[1]), Path(sys.argv[2]))" \
    "/tmp/mo-$fam" "models/$name" || return 6
  cp "/tmp/mo-$fam/train.log" "models/$name/train_mtp.log"
  rm -f "models/$name"/train_mtp.[0-9].log
  tar -C models -cf "$OUT/$name.tar" "$name"
  echo "MTP installed at $(( $(date +%s) - START )) s"
}
mtp kimi > "$OUT/kimi-mtp.stdout" 2>&1 &
pk=$!
mtp glm > "$OUT/glm-mtp.stdout" 2>&1 &
pg=$!
timeout 240 python3 -m pytest -n 4 -m gpu -p no:cacheprovider -p no:benchmark --tb=short --timeout 200 -rfE \
  tests/backend/engine/test_speculative_cuda.py tests/backend/engine/test_decode_graphs_cuda.py \
  tests/kernels/test_mla_decode.py tests/kernels/test_dsa_indexer_triton.py > "$OUT/pytest_gpu.log" 2>&1
echo "== tests rc=$? at $(( $(date +%s) - START ))s"; grep -E "passed|failed|FAILED|^ERROR|Timeout|disabled" "$OUT/pytest_gpu.log" | tail -20
wait $pk; rk=$?; wait $pg; rg=$?
echo "== mtp stages rc kimi=$rk glm=$rg at $(( $(date +%s) - START ))s"
for fam in kimi glm; do echo "-- $fam"; grep -E "\] " "$OUT/$fam-mtp.stdout" | grep -vE "step [0-9]+ " | tail -6; grep -E "step [0-9]+ " "$OUT/$fam-mtp.stdout" | tail -2; done
left=$(( END_S - ($(date +%s) - START) - 60 ))
if [ "$rk" = 0 ] && [ "$rg" = 0 ] && [ "$left" -gt 60 ]; then
  timeout $(( left + 50 )) python3 -m benchmarks.cli engine mtp --budget-s "$left" --out "$OUT/mtp-gpu.json" > "$OUT/mtp-gpu.log" 2>&1
  echo "== mtp bench rc=$? at $(( $(date +%s) - START ))s"; grep -v Warning "$OUT/mtp-gpu.log" | tail -25
fi
