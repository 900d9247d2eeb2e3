#!/usr/bin/env bash
# Session 25's last H100 call (issue 25, ~280 s): integrity_overhead (page-tag check on vs off at c=64,
# Kimi K2.6 rank 0 of 8, 8 layers) with more rounds than the 2026-12-04 H200 records (+2.85% [+0.34, +9.51]).
#   run(command="timeout -s KILL 330 bash lab/device/r25c.sh", carry=[".whl"], timeout_s=340)
source "$(dirname "$0")/preamble.sh"
timeout ${BUDGET_S:-260} python3 -m benchmarks.cli engine scenario integrity_overhead --rank-of 8 --layers 8 \
  --rounds ${ROUNDS:-9} --budget-s $(( ${BUDGET_S:-260} - 30 )) --out "$OUT/integrity_overhead.json" > "$OUT/integrity.log" 2>&1
echo "== rc=$? at $(el)s"; grep -E "^\| |summary|overhead" "$OUT/integrity.log" | tail -30
