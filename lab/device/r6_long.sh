#!/usr/bin/env bash
# fp8kv_vs_bf16kv_long_c64 at its own point (issue 25): Kimi K2.6, rank 0 of 8, 64 requests of
# 16,384 prompt / 4,096 output tokens at once, FP8 KV / BF16 KV, 3 A/B/B/A rounds, one H200, one call:
#   run(command="bash lab/device/r6_long.sh", carry=[".whl"], timeout_s=600)        # ~6-9 min
# Everything lands in $OUT/r6_long.tgz (the record .json/.md, the log); the last lines printed are
# the summary row, the warm-up line, the decode-graph line and the 12 runs.
#
# Depth 2 (1 dense + 1 MoE layer): the KV pool per layer is the full deployment's per-GPU pool
# (FP8 1,364,736 tokens holds all 64 requests of 20,480; BF16 682,368 holds 41 prompts, 33 at full
# length: the rest queue, 8 are preempted and recomputed), so capacity — the scenario's point — is
# the same at any depth; depth only scales each step's weight reads (the record says which depth).
# Warm-up: each side runs the workload at 1,024 output tokens (the same admission, queueing and
# chunking), then one probe step for each step shape the scheduler plans for the 4,096-token run
# that this pass did not run (benchmarks/engine/warm_plan.py: at full size, FP8 none of 129, BF16 one
# of 83, (1347, 31)); the record still checks the warm-up against the timed runs' own shapes.
#
# Time budget (LIMIT 540 s from the script's start; no round starts that would not end inside it):
#   pip + start-up + build (INT4 experts, FP8 KV calibration, 8 decode-graph buckets)   ~35 s
#   warm-up: plans (~4 s a side) + 64 x 16,384 / 1,024 per side (the 4-layer record's 19 s, ~0.55x
#     at 2 layers) + probes                                                            ~30 s
#   a round (A, B, B, A): FP8 ~20-29 s a run (521 prefill steps + 4,095 decode steps at 64 rows),
#     BF16 ~28-41 s (8,457 steps: two waves of <= 41 rows, 8 recomputes)               ~100-140 s
#   3 rounds                                                                           ~300-420 s
#   total                                                                              ~365-485 s
# If a record comes back with fewer than 3 complete rounds, run this again (ROUNDS=1 or 2) and merge:
#   kumo bench engine report A.json B.json --out benchmarks/results/DATE-rank-of-8-fp8kv-vs-bf16kv-long-c64.json
TAG=r6_long
source "$(dirname "$0")/r6_lib.sh"
if [ "$TINY" = 1 ]; then  # the small geometry: rank 0 of 4, lengths 24 / 6, a pool 3 BF16 requests fill
  scenario fp8kv_vs_bf16kv_long_c64 "$(left)" 10 --tiny --device cpu --rank-of 4 --layers 2 \
    --pool-scale 0.002 --warm-up-lengths 24 2 --rounds "${ROUNDS:-3}"
else
  scenario fp8kv_vs_bf16kv_long_c64 "$(left)" 300 --rank-of 8 --layers "${LONG_LAYERS:-2}" \
    --warm-up-lengths 16384 "${WARM_OUT:-1024}" --rounds "${ROUNDS:-3}"
fi
echo "== done at ${SECONDS}s of ${LIMIT}s"
archive
