#!/usr/bin/env bash
# Issue 25's remaining figures on one H200, a stage a call, carry [".whl"]:
#   run(command="bash lab/device/r6_bench.sh engine", carry=[".whl"], timeout_s=600)   # ~8-9 min
#   run(command="bash lab/device/r6_bench.sh serve", carry=[".whl"], timeout_s=600)    # ~6-8 min
# Everything lands in $OUT/r6_bench-STAGE.tgz; the last lines printed are the summary.
#
# engine (LIMIT 540 s from the script's start; a scenario is skipped, said so, below its minimum):
#   int4_vs_fp8_decode_c1  GLM 5.2, rank 0 of 8, 50 of 78 layers (both formats fit one H200 together
#                only so), c=1, 2,048 / 256, 3 rounds: build ~35 s, warm-up ~15 s, 12 runs of ~4-7 s
#                (the 2026-12-04 record: TPOT 25 ms, 0.5 ms a layer; its record predates the
#                decode-graph fields: this one says whether decode replayed CUDA graphs)    ~110-140 s
#   vs_transformers_c64  Kimi K2.6, 3 layers (what transformers fits beside Kumo), c=64, 2,048 / 256,
#                Kumo (INT4 experts, FP8 KV) / transformers `generate` (bf16, SDPA; its prefill
#                chunked at 512, the whole batch's does not fit): builds ~60 s, warm-up ~50 s, a round
#                ~95 s (transformers ~40 s a run, Kumo ~6 s)                              ~350-400 s
#                (the rest of the call: no round starts that would not end inside it)
# serve (LIMIT 540 s):
#   write the random checkpoints of the full published geometries, truncated (backend/tools/
#     random_geometry.py, drawn on the GPU): Kimi K2.6 2 layers (1 dense + 1 MoE, 16.4 GB), GLM 5.2
#     4 layers (3 dense + 1 MoE, 12.1 GB), INT4 g32 routed experts, the rest BF16     ~40-80 s
#   `kumo serve --device cuda` serving the two nano models as served by default (INT4 experts + FP8
#     KV) and both truncated checkpoints (`--model`; BF16 KV, 1,024 pages), each backend warmed
#     before ready (READY_S, 300 s at most)                                              ~60-120 s
#   `kumo bench serve` through the gateway, 1,024 / 256 tokens, 3 repeats of DURATION (8) s a point,
#     in this order until the time is spent: every model at c=1, the nano models at c=16, the
#     truncated ones at c=8 (their 1,024-page pools hold 8 x 1,280 tokens); ~35 s a point  ~280 s
TAG=r6_bench-${1:?engine|serve}
stage=$1
source "$(dirname "$0")/r6_lib.sh"

case $stage in
  engine)
    if [ "$TINY" = 1 ]; then
      scenario int4_vs_fp8_decode_c1 60 10 --tiny --device cpu --rank-of 4 --layers 2 --pool-scale 0.1 --rounds 3
      scenario vs_transformers_c64 "$(left)" 10 --tiny --device cpu --rounds 3
    else
      scenario int4_vs_fp8_decode_c1 150 100 --rank-of 8 --layers 50 --pool-scale 0.1 --rounds 3
      scenario vs_transformers_c64 "$(left)" 250 --rounds 3
    fi
    ;;
  serve)  # READY_S (start-up limit, 300), DURATION (s a repeat, 8), INPUT_LEN (1024), OUTPUT_LEN (256)
    # the checkpoints in RAM (/dev/shm, 64 GiB of the 128): a slow disk would take minutes for 28.5 GB
    # (this VM's wrote 4.6 GB in 62 s); kumo serve's data dir on disk
    ckpt=/tmp/kumo-geometries; [ -d /dev/shm ] && ckpt=/dev/shm/kumo-geometries
    data=/tmp/kumo-serve port=${PORT:-8787} account=ACCOUNT token=TOKEN note=NOTE
    duration=${DURATION:-8}
    point_s=$((3 * duration + 27))  # calibration, one warm-up request, 3 windows
    kimi=@cf/kumo/kimi-k2.6-full-2l glm=@cf/kumo/glm-5.2-full-4l
    geometry() {  # KIND LAYERS FOLDER: a full-geometry random checkpoint, drawn on the GPU
      local cmd=("$PYTHON" -m backend.tools.random_geometry "$1" "$3" --layers "$2" --device cuda)
      if [ "$DRY" = 1 ]; then echo "${cmd[*]}"; return; fi
      local limit=$(left); [ "$limit" -gt 240 ] && limit=240
      [ -f "$3/config.json" ] || timeout "$limit" "${cmd[@]}" >> "$LOGS/geometry.log" 2>&1
      echo "== $1 $2 layers at ${SECONDS}s: $(tail -1 "$LOGS/geometry.log")"
    }
    bench() {  # MODEL CONCURRENCY: one point, 3 repeats, its record in $LOGS
      local name="serve-${1##*/}-c$2"
      if [ "$DRY" = 0 ] && [ "$(left)" -lt "$point_s" ]; then echo "== $1 c=$2: skipped, $(left)s left"; return; fi
      local cmd=("$PYTHON" -m benchmarks.cli serve --url "http://127.0.0.1:$port" --account "$account" --token "$token"
        --model "$1" --concurrency "$2" --input-len "${INPUT_LEN:-1024}" --output-len "${OUTPUT_LEN:-256}"
        --duration "$duration" --repeats 3 --slo-ttft-ms 1000 --slo-tpot-ms 50 --machine "$note" --out "$LOGS/$name.json")
      if [ "$DRY" = 1 ]; then echo "${cmd[*]}"; return; fi
      timeout $((point_s + 60)) "${cmd[@]}" > "$LOGS/$name.log" 2>&1
      echo "== $1 c=$2 rc=$? at ${SECONDS}s"; tail -1 "$LOGS/$name.log"
      archive
    }
    server_cmd=("$PYTHON" -m gateway.cli serve --device cuda --data-dir "$data" --port "$port"
      --model "$kimi=$ckpt/kimi-k2.6-2l" --model "$glm=$ckpt/glm-5.2-4l")
    points=("@cf/moonshotai/kimi-k2.6 1" "@cf/zai-org/glm-5.2 1" "$kimi 1" "$glm 1"
      "@cf/moonshotai/kimi-k2.6 16" "@cf/zai-org/glm-5.2 16" "$kimi 8" "$glm 8")
    if [ "$DRY" = 1 ]; then
      geometry kimi-k2.6 2 "$ckpt/kimi-k2.6-2l"; geometry glm-5.2 4 "$ckpt/glm-5.2-4l"
      echo "${server_cmd[*]}"
      for p in "${points[@]}"; do bench $p; done
      exit 0
    fi
    geometry kimi-k2.6 2 "$ckpt/kimi-k2.6-2l"
    geometry glm-5.2 4 "$ckpt/glm-5.2-4l"
    df -h "$ckpt" | tail -1
    fresh=yes; [ -d "$data" ] && fresh="no (its conversions and compile cache kept from an earlier start)"
    start=$SECONDS
    "${server_cmd[@]}" > "$LOGS/serve.stdout" 2> "$LOGS/serve.stderr" &
    server=$!
    until grep -q "API token:" "$LOGS/serve.stdout" 2>/dev/null; do
      if ! kill -0 "$server" 2>/dev/null || [ $((SECONDS - start)) -gt "${READY_S:-300}" ] || [ "$(left)" -lt "$point_s" ]; then
        echo "== kumo serve not ready after $((SECONDS - start))s"; tail -20 "$LOGS/serve.stdout" "$LOGS/serve.stderr"
        tail -20 "$data"/logs/*.log; kill -TERM "$server" 2>/dev/null; wait "$server"
        cp "$data"/logs/*.log "$LOGS/" 2>/dev/null; archive; exit 1
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
    note="${gpu:-no GPU} ($(nproc --all) CPUs), kumo serve --device cuda: the nano models as INT4 experts + FP8 KV;"
    note="$note $kimi and $glm: random weights of the full published geometry, truncated to 2 and 4 layers"
    note="$note (INT4 g32 routed experts, BF16 KV, 1,024 pages); this client on the same machine; kumo serve"
    note="$note ready ${ready_s} s after its start, data dir fresh: $fresh (backends: $warm)"
    echo "== kumo serve ready in ${ready_s}s: $warm"
    for p in "${points[@]}"; do bench $p; done
    kill -TERM "$server"; wait "$server"; echo "== kumo serve stopped: rc=$?"
    cp "$data"/logs/*.log "$LOGS/" 2>/dev/null
    sed -i 's/\(API token: *\|Admin token: *\|TOKEN=\|KUMO_ADMIN_TOKEN=\)\S*/\1(removed)/' "$LOGS/serve.stdout"
    ;;
  *)
    echo "unknown stage $stage (engine|serve)" >&2
    exit 2
    ;;
esac
echo "== done at ${SECONDS}s of ${LIMIT}s"
archive
