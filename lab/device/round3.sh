#!/usr/bin/env bash
# Round 3's device calls (issue 25), one stage a call on one H200, carry [".whl"] as round2.sh:
#   run(command="bash lab/device/round3.sh scenarios", carry=[".whl"], timeout_s=600)   # ≤ 9 min
#   run(command="bash lab/device/round3.sh serve", carry=[".whl"], timeout_s=300)       # ≤ 4 min
# The JSON records land in $OUT, and beside them one archive, round3-STAGE-logs.tgz, of everything
# (records, Markdown, logs; $OUT brings back 8 files at most); the last lines printed are the summary.
#
# scenarios: the summary keys not yet measured, most valuable first, each its own process (so each
#   writes its record before the next starts, whatever happens to a later one), each warm and A/B/B/A
#   with >= 3 rounds; the call's budget (LIMIT s from the script's start, default 530) is shared out,
#   a later scenario gets what is left and is skipped (said so) below its minimum. Estimates, from
#   the 2026-12-04 rank-of-8 records (Kimi full depth: a 2,048-token chunk 226 ms, c=1 decode 15.3
#   ms a step, eager; GLM at 50 layers: a chunk ~235 ms, build ~25 s) and per-layer scaling:
#     fp8kv_vs_bf16kv_long_c64  Kimi, rank 0 of 8, 4 layers, the full per-GPU pools (FP8 1,364,736
#                   tokens holds all 64 requests of 16,384 + 1,024; BF16 682,368 holds 39): a run
#                   prefills 1.05M tokens (~10 s) and decodes 1,024 steps at 64 rows (FP8) or
#                   ~2 x 1,024 at <= 39 (BF16): ~14 / ~20 s; build, 2 warm-ups, 12 timed ~ 250 s
#                   (4,096 output tokens would take ~2.5x: not with >= 3 rounds in one call;
#                   LONG_OUT=4096 LIMIT=530 alone gives the full workload about 2 rounds)
#     integrity_overhead  Kimi, rank 0 of 8, 8 layers, 64 x 2,048 / 256, 5 rounds: ~3.5 s a run, ~75 s
#     int4_vs_fp8_prefill GLM 5.2, rank 0 of 8, 50 layers (both formats fit one H200 together only
#                   so), one 8,192-token prompt, 5 rounds: build ~25 s, ~1.2 s a run, ~75 s
#     capacity_fp8_over_bf16  Kimi, rank 0 of 8, 2 layers (a count: the pool in tokens is the full
#                   model's per-GPU pool at any depth), 16,384-token prompts filling the pool, 8,192-token
#                   chunks, up to 128 running: ~1.4M / 0.7M prefill tokens a fill, ~45 s
# serve: `kumo serve --device cuda` (the embedded default: the nano models as INT4 experts + FP8 KV,
#   warmed before ready), then `kumo bench serve` through the gateway at c=1 and c=16 per model, 15 s
#   each; the start-up time to ready (first start: the nano models converted on the CPU, ~55 s on the
#   2-core VM, then each backend's warm-up compiles every step shape) goes into each record's machine
#   note. Start-up is cut at READY_S (150 s); a second call on the same machine finds the data dir's
#   conversions and compile cache and starts in seconds.
#
# TINY=1: the same stage on the CPU at --tiny scale (no wheels, no GPU; PYTHON picks the interpreter);
# DRY=1: print the commands the stage would run (tests/benchmarks/test_round3_script.py parses them).
set -uo pipefail
stage=${1:?scenarios|serve}
OUT=${OUT:-/tmp/out}
PYTHON=${PYTHON:-python3}
TINY=${TINY:-0}
DRY=${DRY:-0}
LIMIT=${LIMIT:-530}
LOGS=${LOGS:-/tmp/round3-logs}/$stage  # all a stage writes; $OUT gets the records and an archive of this
EXIT_S=15  # a scenario's process after its deadline: the run in flight cut, the record written
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1
if [ "$TINY" = 0 ] && [ "$DRY" = 0 ]; then
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv,noheader
  rm -rf /tmp/site && $PYTHON -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi

# scenario NAME BUDGET MIN ARGS...: one scenario in its own process, inside what is left of LIMIT
scenario() {
  local name=$1 budget=$2 min=$3 left
  shift 3
  left=$((LIMIT - SECONDS - EXIT_S))
  [ "$budget" -gt "$left" ] && budget=$left
  if [ "$budget" -lt "$min" ]; then
    echo "== $name: skipped, ${left}s left of the call (it needs ${min}s)"
    return
  fi
  local cmd=("$PYTHON" -m benchmarks.cli engine scenario "$name" "$@" --budget-s "$budget" --out "$LOGS/$name.json")
  if [ "$DRY" = 1 ]; then
    echo "${cmd[*]}"
    return
  fi
  timeout $((budget + 45)) "${cmd[@]}" > "$LOGS/$name.log" 2>&1
  echo "== $name rc=$? at ${SECONDS}s (budget ${budget}s)"
  grep -E "^\| $name \||^Beside|^Warm-up|^No warm-up" "$LOGS/$name.log" | sed 's/ | not measured here.*//'
  cp "$LOGS/$name.json" "$OUT/" 2>/dev/null
  archive scenarios  # after each: what a later scenario's overrun cannot take back
}

archive() { tar -czf "$OUT/round3-$1-logs.tgz" -C "$LOGS" .; }

case $stage in
  scenarios)
    if [ "$TINY" = 1 ]; then  # the small geometry: 4 heads, so rank 0 of 4; the scenarios' tiny lengths
      small=(--tiny --device cpu --rank-of 4 --layers 2)
      scenario fp8kv_vs_bf16kv_long_c64 "${LONG_BUDGET:-60}" 20 "${small[@]}" --pool-scale 0.002 --rounds 3
      scenario integrity_overhead 40 10 "${small[@]}" --rounds 5
      scenario int4_vs_fp8_prefill 40 10 "${small[@]}" --pool-scale 0.1 --rounds 5
      scenario capacity_fp8_over_bf16 30 10 "${small[@]}" --pool-scale 0.002 --concurrency 16 --chunk 64 --rounds 3
    else
      scenario fp8kv_vs_bf16kv_long_c64 "${LONG_BUDGET:-250}" 150 --rank-of 8 --layers "${LONG_LAYERS:-4}" \
        --output-len "${LONG_OUT:-1024}" --rounds 3
      scenario integrity_overhead 75 40 --rank-of 8 --layers 8 --rounds 5
      scenario int4_vs_fp8_prefill 85 50 --rank-of 8 --layers 50 --pool-scale 0.1 --rounds 5
      scenario capacity_fp8_over_bf16 45 30 --rank-of 8 --layers 2 --concurrency 128 --chunk 8192 --rounds 3
    fi
    echo "== done at ${SECONDS}s of ${LIMIT}s"
    ;;
  serve)  # READY_S (start-up limit, default 150), DURATION (s a point, default 15), INPUT_LEN, OUTPUT_LEN
    if [ "$TINY" = 1 ]; then device=cpu; data=${DATA:-/tmp/kumo-serve-tiny}; else device=cuda; data=/tmp/kumo-serve; fi
    port=${PORT:-8787} account=ACCOUNT token=TOKEN note=NOTE
    server_cmd=("$PYTHON" -m gateway.cli serve --device "$device" --data-dir "$data" --port "$port")
    # bench MODEL CONCURRENCY: `kumo bench serve` at one point through the gateway, its record in $OUT
    bench() {
      local name="serve-${1##*/}-c$2"
      local cmd=("$PYTHON" -m benchmarks.cli serve --url "http://127.0.0.1:$port" --account "$account" --token "$token"
        --model "$1" --concurrency "$2" --input-len "${INPUT_LEN:-1024}" --output-len "${OUTPUT_LEN:-256}"
        --duration "${DURATION:-15}" --slo-ttft-ms 1000 --slo-tpot-ms 50 --machine "$note" --out "$LOGS/$name.json")
      if [ "$DRY" = 1 ]; then echo "${cmd[*]}"; return; fi
      timeout $((${DURATION:-15} + 90)) "${cmd[@]}" > "$LOGS/$name.log" 2>&1
      echo "== $1 c=$2 rc=$? at ${SECONDS}s"; tail -1 "$LOGS/$name.log"
    }
    points=(@cf/moonshotai/kimi-k2.6 @cf/zai-org/glm-5.2)
    if [ "$DRY" = 1 ]; then
      echo "${server_cmd[*]}"
      for m in "${points[@]}"; do bench "$m" 1; bench "$m" 16; done
      exit 0
    fi
    # the gateway's dependencies (pyproject.toml) must import here: say which do not, in seconds, not minutes
    $PYTHON -c "
import importlib.util as u
names = 'starlette uvicorn httptools httpx msgspec structlog sqlalchemy aiosqlite asyncpg alembic redis prometheus_client jinja2 PIL tokenizers tiktoken llguidance safetensors tqdm'
missing = [n for n in names.split() if u.find_spec(n) is None]
raise SystemExit('== missing for kumo serve: ' + ' '.join(missing) if missing else 0)" || exit 1
    fresh=yes; [ -d "$data" ] && fresh="no (its conversions and compile cache kept from an earlier start)"
    start=$SECONDS
    "${server_cmd[@]}" > "$LOGS/serve.stdout" 2> "$LOGS/serve.stderr" &
    server=$!
    until grep -q "API token:" "$LOGS/serve.stdout" 2>/dev/null; do
      if ! kill -0 "$server" 2>/dev/null || [ $((SECONDS - start)) -gt "${READY_S:-150}" ]; then
        echo "== kumo serve not ready after $((SECONDS - start))s"; tail -20 "$LOGS/serve.stdout" "$LOGS/serve.stderr"
        tail -20 "$data"/logs/*.log; kill -TERM "$server" 2>/dev/null; wait "$server"
        cp "$data"/logs/*.log "$LOGS/" 2>/dev/null; archive serve; exit 1
      fi
      sleep 1
    done
    ready_s=$((SECONDS - start))
    account=$(sed -n 's/.*Account ID: \([0-9a-f]\{32\}\).*/\1/p' "$LOGS/serve.stdout")
    token=$(sed -n 's/.*API token:  \(\S\+\).*/\1/p' "$LOGS/serve.stdout")
    warm=$(for log in "$data"/logs/*.log; do  # the logs are appended to: this start's line is the last
      grep -o "kumo backend: \S* ready in [0-9.]* s, of which warm-up [0-9.]* s" "$log" | tail -1; done \
      | sed 's/^kumo backend: //' | paste -sd ';' | sed 's/;/; /g')
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
    note="${gpu:-no GPU} ($(nproc --all) CPUs), kumo serve --device $device (the nano models as INT4 experts + FP8 KV)"
    note="$note and this client on one machine; kumo serve ready ${ready_s} s after its start, data dir fresh: $fresh (backends: $warm)"
    echo "== kumo serve ready in ${ready_s}s: $warm"
    for m in "${points[@]}"; do bench "$m" 1; bench "$m" 16; done
    kill -TERM "$server"; wait "$server"; echo "== kumo serve stopped: rc=$?"
    cp "$data"/logs/*.log "$LOGS/" 2>/dev/null
    sed -i 's/\(API token: *\|Admin token: *\|TOKEN=\|KUMO_ADMIN_TOKEN=\)\S*/\1(removed)/' "$LOGS/serve.stdout"
    cp "$LOGS"/serve-*.json "$OUT/" 2>/dev/null
    archive serve
    ;;
  *)
    echo "unknown stage $stage (scenarios|serve)" >&2
    exit 2
    ;;
esac
