#!/usr/bin/env bash
# Score both nano models on their held-out test sets with `kumo eval` in one device call (issue 7):
#   run(command="bash lab/device/eval_models.sh", carry=[".whl"])
# Needs models/kimi-k2.6-nano and models/glm-5.2-nano in the tree, and in .whl/ the msgspec and
# llguidance wheels (cp312, manylinux; the image has neither; llguidance is only imported). Three
# variants each: FP8-channel weights first (issue 7's goal compares INT4 + FP8 KV with FP8, and the paired
# deltas are taken against the first variant); bf16; INT4-g32 experts + FP8 KV; then bf16 on the GPU against
# bf16 on the CPU path (100 items a task; GPU_VS_CPU=, empty, turns it off); beside them (PREFILL_PATHS=) GLM's INT4 prefill
# paths W4A8 and expand-fp8 against W4A16 (issue 6; PP_ITEMS a task, 1,000). QUALITY= (empty) leaves the quality table out. The reports come back as $OUT/quality-<model>.json and
# $OUT/gpu-vs-cpu-<model>.json, the tables as $OUT/eval-<model>.log.
set -uo pipefail
OUT=${OUT:-/tmp/out}
MODELS=${MODELS_DIR:-models}  # lab/device/device_plan.sh: the last training call's folders on a warm machine
mkdir -p "$OUT"
SITE=${SITE:-/tmp/site}  # lab/device/device_plan.sh gpu-checks: its own, beside the checks' /tmp/site
rm -rf "$SITE"; python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/msgspec-*.whl \
    .whl/llguidance-*.whl 2>&1 | tail -2
export PYTHONPATH=$SITE:. PYTHONUNBUFFERED=1
quality() {  # one model's task: the three variants (one process per task, all at once: on 2026-12-02 one
    # process per model took 4 min for GLM's five tasks and 8 for Kimi's six)
    local name=$1 data=$2
    python3 -m backend.tools.eval --device cuda --dtype bfloat16 --max-new-tokens 256 \
        --variant fp8=$MODELS/$name:weights=fp8-channel \
        --variant bf16=$MODELS/$name \
        --variant int4-fp8kv=$MODELS/$name:weights=int4-g32:kv=fp8 \
        --data "$data" --out "$OUT/q-$name-$(basename "$data" .test.jsonl).json"
}
gpu_vs_cpu() {  # the GPU kernels against the CPU path's torch references, same checkpoint and dtype: KL and
    # top-1 agreement on the first GPU_VS_CPU_ITEMS items of each task (the CPU path is the slow one: on
    # 2026-12-02 300 items did not finish in the 5 minutes GLM had left after its quality table)
    local fam=$1 name=$2 sub=(); mkdir -p /tmp/sub-$fam
    for f in /tmp/data-$fam/*.test.jsonl; do head -n "${GPU_VS_CPU_ITEMS:-100}" "$f" > /tmp/sub-$fam/$(basename "$f"); sub+=(--data /tmp/sub-$fam/$(basename "$f")); done
    # a bounded thread count, a guess at why two of these at once (torch's default: a thread a core each)
    # printed nothing in 150 s on 16 items a task on the H200 (2026-12-02), where a 2-core VM takes ~10 s
    OMP_NUM_THREADS=${GPU_VS_CPU_THREADS:-6} python3 -m backend.tools.eval --device cuda --dtype bfloat16 --max-new-tokens 256 \
        --variant gpu=$MODELS/$name --variant cpu=$MODELS/$name:device=cpu \
        "${sub[@]}" --out "$OUT/gpu-vs-cpu-$name.json"
}
prefill_paths() {  # issue 6: W4A8 (INT4 -> FP8 in the kernel, FP8 activations) and expand-fp8 against W4A16,
    # every Linear INT4 (all-linear: the routed experts alone run the fused MoE, not these paths), every
    # product through the chosen path (kumo eval sets the threshold to 1 token); GLM, 1,000 items a task
    local name=glm-5.2-nano data=(); mkdir -p /tmp/pp
    python3 -m models.recipes.build --out /tmp/data-pp --family glm --train-items 0 > /dev/null || return 4
    for f in /tmp/data-pp/*.test.jsonl; do head -n "${PP_ITEMS:-1000}" "$f" > /tmp/pp/$(basename "$f"); data+=(--data /tmp/pp/$(basename "$f")); done
    python3 -m backend.tools.eval --device cuda --dtype bfloat16 --max-new-tokens 256 \
        --variant w4a16=$MODELS/$name:weights=int4-g32:all-linear \
        --variant w4a8=$MODELS/$name:weights=int4-g32:all-linear:int4-prefill=w4a8 \
        --variant expand-fp8=$MODELS/$name:weights=int4-g32:all-linear:int4-prefill=expand-fp8 \
        "${data[@]}" --out "$OUT/quality-int4-prefill-$name.json"
}
pids=()
[ -n "${PREFILL_PATHS-1}" ] && { (time prefill_paths) > "$OUT/eval-int4-prefill.log" 2>&1 & pids+=($!); }
for fam in kimi glm; do  # everything at once: the models are small, the GPU and the 16 cores are shared
    name=$([ $fam = kimi ] && echo kimi-k2.6-nano || echo glm-5.2-nano)
    [ -d "$MODELS/$name" ] || { echo "$MODELS/$name is missing"; exit 3; }
    python3 -m models.recipes.build --out /tmp/data-$fam --family $fam --train-items 0 || exit 4
    for f in /tmp/data-$fam/*.test.jsonl; do
        [ -n "${QUALITY-1}" ] || break  # QUALITY= (empty): no quality table, the other parts only
        (time quality $name "$f") > "$OUT/eval-$name-$(basename "$f" .test.jsonl).log" 2>&1 &
        pids+=($!)
    done
    [ -n "${GPU_VS_CPU-1}" ] && { (time gpu_vs_cpu $fam $name) > "$OUT/eval-gpu-vs-cpu-$name.log" 2>&1 & pids+=($!); }
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
# one report per model, in kumo eval's schema: the per-task reports' tasks in one list
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
for name in ("kimi-k2.6-nano", "glm-5.2-nano"):
    parts = sorted(glob.glob(f"{out}/q-{name}-*.json"))
    if parts:
        reports = [json.load(open(p)) for p in parts]
        merged = {**reports[0], "tasks": [t for r in reports for t in r["tasks"]]}
        json.dump(merged, open(f"{out}/quality-{name}.json", "w"), indent=1)
        for p in parts:
            os.remove(p)
PY
for f in "$OUT"/eval-*.log; do echo "== $(basename "$f" .log)"; grep -v "^\s*$" "$f" | tail -n 14; done
exit $rc
