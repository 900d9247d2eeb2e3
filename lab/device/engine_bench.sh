#!/usr/bin/env bash
# One device call = one comparison of `kumo bench engine`; record, table and plots go to $OUT.
# Usage (device tool, carry [".whl"] holding msgspec's wheel):
#   bash lab/device/engine_bench.sh weights|kv|integrity|transformers [extra flags]
# BUDGET_S bounds the runs (default 450; transformers 330), the outer timeout the whole command; TAG names
# the record (engine-<name>-<TAG>.json) when one call runs the same comparison twice.
set -u
name=$1; shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/msgspec-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv
default_budget=450
extra=()
# transformers: 3 layers (1 dense + 2 MoE), not 4: at 4 its bf16 Kimi (105 GB of weights) ran out of memory at
# concurrency 64 on 2026-12-02, so the ratio at 64 was never measured; Kumo's variants run at 3 layers beside it
if [ "$name" = transformers ]; then default_budget=330; extra=(--max-concurrency-cap 0 --layers 3); fi
# integrity: EngineConfig.check_page_tags on/off, A/B rounds of c=64, 2k in / 256 out (~1 min a round on
# the H200, after ~80 s of build, warm-up and one untimed run each; rounds past the budget are skipped)
if [ "$name" = integrity ]; then extra=(--integrity-concurrency 64 --repeats 5); fi
timeout 590 python3 -m benchmarks.cli engine "$name" --budget-s "${BUDGET_S:-$default_budget}" "${extra[@]}" "$@" \
  --out "$OUT/engine-$name${TAG:+-$TAG}.json" 2>&1 | grep -v Warning | tee "$OUT/engine-$name${TAG:+-$TAG}.log"
