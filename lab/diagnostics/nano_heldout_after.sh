#!/usr/bin/env bash
# Issue 26, after `lab/device/round3_train.sh`: install the two retrained nano checkpoints and score them
# against the ones they replace, paired, on the CPU (~5 minutes with 2 threads):
#   bash lab/diagnostics/nano_heldout_after.sh <files_at>        (the folder holding the two .tar files)
# 1. the committed folders are copied to $OLD (/tmp/nano-old, once), the tars untarred into models/;
# 2. the held-out everyday sets (kumo eval --heldout, 40 items a set) -> lab/results/2026-12-04-heldout/after-<fam>.json;
# 3. the classic test sets of models/recipes/build.py, first ITEMS (200) items a task (the regression check)
#    -> lab/results/2026-12-04-heldout/classic-<fam>.json.
set -euo pipefail
FILES=${1:?the folder holding glm-5.2-nano.tar and/or kimi-k2.6-nano.tar}
PY=${PYTHON:-/work/main/.venv/bin/python}
ITEMS=${ITEMS:-200}
OLD=${OLD:-/tmp/nano-old}  # the replaced checkpoints, kept for the paired comparison
RES=${RES:-lab/results/2026-12-04-heldout}
export PYTHONPATH=$PWD OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
mkdir -p "$RES"
NAMES=()
for name in glm-5.2-nano kimi-k2.6-nano; do
  [ -e "$FILES/$name.tar" ] || continue  # a call may retrain one family
  NAMES+=("$name")
  [ -d "$OLD/$name" ] || { mkdir -p "$OLD" && cp -r "models/$name" "$OLD/$name"; }
  rm -rf "models/$name" && tar -C models -xf "$FILES/$name.tar"
done
for name in "${NAMES[@]}"; do
  fam=${name%%-*}
  $PY -m backend.tools.eval --heldout "$fam" --heldout-items "${HELDOUT_ITEMS:-40}" --device cpu --batch-size 64 \
    --variant before="$OLD/$name" --variant after="models/$name" --out "$RES/after-$fam.json"
  $PY -m models.recipes.build --out "/tmp/classic-$fam" --family "$fam" --train-items 0 > /dev/null
  data=()
  for f in /tmp/classic-"$fam"/*.test.jsonl; do
    head -n "$ITEMS" "$f" > "/tmp/classic-$fam/$(basename "$f" .test.jsonl).jsonl"
    data+=(--data "/tmp/classic-$fam/$(basename "$f" .test.jsonl).jsonl")
  done
  $PY -m backend.tools.eval --device cpu --batch-size 64 --variant before="$OLD/$name" \
    --variant after="models/$name" "${data[@]}" --out "$RES/classic-$fam.json"
done
