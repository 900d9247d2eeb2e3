#!/usr/bin/env bash
# Issue 24, MLA decode over an FP8 latent cache by e4m3 dots (session 12, branch r12-mlafp8): one H200 call
# per stage, each <= 300 s. A fresh checkout has no .whl/: `bash lab/device/wheels.sh` first.
#   run(command="bash lab/device/r12_mla_fp8.sh", carry=[".whl"], timeout_s=330)       # tests, then the A/B
#   run(command="bash lab/device/r12_mla_fp8.sh eval", carry=[".whl"], timeout_s=330)  # the accuracy gate
# Stages (first argument): all (tests then ab, the default) | tests | ab | eval.
# - tests (<= 140 s): the MLA decode and prefill gpu tests, the FP8-dot ones (8 / 16 / 64 heads at 32k tokens, tagged
#   pages, against the same-numerics emulation and the exact op) among them -> $OUT/pytest_gpu_mla.log
# - ab (<= 140 s): lab.diagnostics.mla_fp8_dot_ab at 8, 16 and 64 heads, batch 64, 32k tokens: BF16 cache,
#   FP8 cache (exact kernel), FP8-dot tiles, in A/B/B/A rounds, copy bandwidth at the start and the end;
#   read the last table: "÷bf16" per arm (goal >= 1.8 at 8 and 16 heads with >= 0.85 of copy, >= 1.3 at 64)
#   -> $OUT/mla_fp8_dot_ab.{log,json}
# - eval (<= 280 s): `kumo eval` on both nano models with the FP8 KV cache, exact kernels (first variant)
#   against `mla=fp8-dot` (every MLA call, prefill and decode, through the FP8-dot tiles), paired, the first
#   ITEMS (default 500) items of each task, one process per task; the gate is |Δ| <= 0.5 points on every
#   task -> $OUT/quality-fp8dot-<model>.json, $OUT/eval-fp8dot-<model>-<task>.log
source "$(dirname "$0")/preamble.sh"
stage=${1:-all}
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4" || echo "")

gpu_tests() {
  # -p no:benchmark: the image's pytest-benchmark warns under xdist (an INTERNALERROR with filterwarnings=error)
  timeout 140 python3 -m pytest -m gpu $workers -p no:cacheprovider -p no:benchmark --tb=short -rfE -q \
    tests/kernels/test_mla_fp8_dot.py tests/kernels/test_mla_decode.py tests/kernels/test_mla_prefill.py \
    > "$OUT/pytest_gpu_mla.log" 2>&1
  echo "== GPU tests rc=$? at $(( $(date +%s) - START )) s"
  grep -E "passed|failed|FAILED|^ERROR|^E " "$OUT/pytest_gpu_mla.log" | tail -20
}

ab() {
  timeout 140 python3 -m lab.diagnostics.mla_fp8_dot_ab --out "$OUT/mla_fp8_dot_ab.json" 2>&1 \
    | grep -v Warning > "$OUT/mla_fp8_dot_ab.log"
  echo "== A/B rc=${PIPESTATUS[0]} at $(( $(date +%s) - START )) s"
  grep -vE "^timed " "$OUT/mla_fp8_dot_ab.log" | tail -24
}

quality() {  # one model's task: the exact FP8 kernels, then the FP8-dot tiles
  local name=$1 data=$2
  timeout 270 python3 -m backend.tools.eval --device cuda --dtype bfloat16 --max-new-tokens 256 \
    --variant exact=models/$name:kv=fp8 --variant fp8dot=models/$name:kv=fp8:mla=fp8-dot \
    --data "$data" --out "$OUT/q-$name-$(basename "$data" .test.jsonl).json"
}

gate() {
  local pids=()
  for fam in kimi glm; do  # every task of both models at once: the models are small, the 16 cores shared
    name=$([ $fam = kimi ] && echo kimi-k2.6-nano || echo glm-5.2-nano)
    python3 -m models.recipes.build --out /tmp/data-$fam --family $fam --train-items 0 > /dev/null || return 4
    mkdir -p /tmp/items-$fam
    for f in /tmp/data-$fam/*.test.jsonl; do
      head -n "${ITEMS:-500}" "$f" > /tmp/items-$fam/$(basename "$f")
      (time quality $name /tmp/items-$fam/$(basename "$f")) \
        > "$OUT/eval-fp8dot-$name-$(basename "$f" .test.jsonl).log" 2>&1 &
      pids+=($!)
    done
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  echo "== eval rc=$rc at $(( $(date +%s) - START )) s"
  python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
for name in ("kimi-k2.6-nano", "glm-5.2-nano"):
    parts = sorted(glob.glob(f"{out}/q-{name}-*.json"))
    if not parts:
        print(f"{name}: no report (see {out}/eval-fp8dot-{name}-*.log)")
        continue
    reports = [json.load(open(p)) for p in parts]
    merged = {**reports[0], "tasks": [t for r in reports for t in r["tasks"]]}
    json.dump(merged, open(f"{out}/quality-fp8dot-{name}.json", "w"), indent=1)
    for p in parts:
        os.remove(p)
    print(f"{name}: fp8dot vs exact (FP8 KV), accuracy points; gate |Δ| <= 0.5")
    for task in merged["tasks"]:
        exact, dot = task["results"][0], task["results"][1]
        if dot.get("delta_vs_first") is None:
            continue
        d, (lo, hi) = 100 * dot["delta_vs_first"], (100 * x for x in dot["delta_ci"])
        verdict = "ok" if abs(d) <= 0.5 else "FAIL"
        print(
            f"  {task['task']:<24} n={task['num_items']:<5} exact {100 * exact['accuracy']:5.1f}  "
            f"Δ {d:+5.2f} [{lo:+.2f}, {hi:+.2f}]  KL {dot['mean_kl']:.1e}  top1 {dot['top1_agreement']:.3f}  {verdict}"
        )
PY
  return $rc
}

case $stage in
  all) gpu_tests; ab ;;
  tests) gpu_tests ;;
  ab) ab ;;
  eval) gate ;;
  *) echo "stage: all | tests | ab | eval" >&2; exit 2 ;;
esac
ls -la "$OUT"
