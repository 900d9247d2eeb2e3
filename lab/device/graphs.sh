#!/usr/bin/env bash
# Issue 22 deliverable 4 on one H200: decode graphs with the collectives captured. One call, ~6 min;
# carry [".whl"] as lab/device/round2.sh does (installed to /tmp/site when present):
#   run(command="bash lab/device/graphs.sh", carry=[".whl"])
# 1. the gpu tests: rank-of decode with graphs equals graphs off, every pure-decode step replayed and a
#    replay calls no collective (test_rank_of.py); two NCCL ranks (test_ranks_cuda.py: skips on 1 GPU).
# 2. GLM 5.2 INT4 (side A of int4_vs_fp8_decode_c1), rank 0 of 8, 50 layers, pool x0.1 (the
#    2026-12-04 record's options: TPOT 25.1 ms), with decode graphs and without, and the graphed run's
#    profiled decode step. The last lines printed are the summary.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv,noheader
if ls .whl/*.whl > /dev/null 2>&1; then
  rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
# -p no:benchmark: the image's pytest-benchmark warns under xdist (an INTERNALERROR with filterwarnings=error)
timeout 260 python3 -m pytest -m gpu -n 3 -p no:cacheprovider -p no:benchmark --tb=short --timeout 240 -rA \
  tests/benchmarks/test_rank_of.py tests/backend/engine/test_ranks_cuda.py > "$OUT/pytest_graphs.log" 2>&1
for graphs in cuda-graphs no-cuda-graphs; do
  extra=$([ "$graphs" = cuda-graphs ] && echo --profile)
  timeout 170 python3 -m benchmarks.cli engine scenario int4_vs_fp8_decode_c1 --rank-of 8 --layers 50 \
    --pool-scale 0.1 --side A --rounds 2 --budget-s 110 --"$graphs" $extra \
    --out "$OUT/rank-of-8-A-$graphs.json" > "$OUT/rank-of-8-A-$graphs.log" 2>&1
  echo "$graphs rc=$?"
done
grep -E "passed|failed|FAILED|^ERROR|SKIPPED|ms/step" "$OUT/pytest_graphs.log" | tail -20
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
for graphs in ("cuda-graphs", "no-cuda-graphs"):
    path = pathlib.Path(sys.argv[1]) / f"rank-of-8-A-{graphs}.json"
    if not path.exists():
        print(graphs, "no record"); continue
    entry = json.loads(path.read_text())["scenarios"]["int4_vs_fp8_decode_c1"]
    print(graphs, "decode_graphs:", entry["sides"]["A"].get("decode_graphs"))
    for run in entry["runs"]:
        print("  ", run["variant"], "TPOT p50 ms", round(run["tpot_ms_p50"] or 0, 2), "replays", run.get("graph_replays"))
    step = (entry.get("step_profile") or {}).get("decode")
    if step:
        print("   profiled decode step: wall", round(step["wall_ms"], 2), "ms, device", round(step["device_ms_total"], 2), "ms")
        for op in step["ops"][:12]:
            print(f"     {op['device_ms']:8.3f} ms x{op['count']:<5} {op['name'][:90]}")
EOF
