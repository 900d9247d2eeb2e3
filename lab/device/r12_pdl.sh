#!/usr/bin/env bash
# Session 12 (issue 24): Programmatic Dependent Launch across the decode path's Triton kernels
# (`kernels/triton_lib.py` has the rules), one H100 or H200, <= 500 s:
# 1. GPU tests: tests/kernels/test_pdl.py (every PDL kernel's sm90 PTX and SASS; a CUDA graph captured
#    over PDL launches holds programmatic edges and replays what it replays without them) and
#    tests/backend/engine/test_pdl_decode_cuda.py (decode graphs captured with PDL on decode, bit for
#    bit, what they decode with it off: tiny GLM 5.2, INT4 and FP8 every Linear, 1 and 16 sequences);
# 2. `kumo bench engine decode-c1 --formats int4-all --pdl-ab` (GLM 5.2 geometry, 10 layers, 2k
#    context): the step over its bytes with PDL on, 3 A/B/B/A rounds, then the step with PDL on (A)
#    against off (B, a second engine on the same weights), 3 rounds: `pdl_ab.step_ratio` = on / off;
# 3. lab/diagnostics/decode_c1_profile.py --pdl on,off: wall and p50 ms a step, kernels a step, the
#    top kernels, each setting its own engine on one model. Under PDL a kernel's time includes its
#    wait for the one before (it starts early), so the kernel sum ("device") overstates the device
#    time there: compare wall and p50;
# 4. with the time left: the GPU tests of every kernel PDL touched (on by default, so their eager
#    launches run with it).
# R8_S=N adds, after 2, the profile at rank 0 of 8, 78 layers (`--rank-of 8`), PDL on then off, within N s
# or what 2 left (~100 s: build ~30 s, two engines; skipped under 80); PROFILE_S=0 drops 3.
# Everything in $OUT/r12_pdl.tgz, packed after each stage (a cut call keeps what came before).
#
#   run(command="bash lab/device/r12_pdl.sh", carry=[".whl"], timeout_s=600)
#
# Time (LIMIT 480 s; a stage starts only if its timeout ends before LIMIT, decode-c1's budget is what
# is left less the profile's 130 s): preamble ~15-25 s; the tests ~100-150 s, cut at 170 (a fresh
# machine compiles both variants of every kernel, PDL on and off, at the tiny shapes; two formats, two
# engines each); decode-c1 ~110 s (build ~35 s as in r10, its rounds ~20 s, the PDL-off engine and its
# capture ~20 s, the A/B rounds ~20 s); the profile ~90 s (one 10-layer model ~25 s, two engines, the
# kernels compiled by then: one Triton cache); the kernel tests take what is left.
#
# CPU dry run (the tiny geometry on the CPU, the GPU tests skipped; about two minutes):
#   TINY=1 OUT=/tmp/r12 PYTHON=/work/main/.venv/bin/python bash lab/device/r12_pdl.sh
set -uo pipefail
TAG=r12_pdl
TINY=${TINY:-0}
LIMIT=${LIMIT:-480}
PYTHON=${PYTHON:-python3}
if [ "$TINY" = 0 ]; then
  source "$(dirname "$0")/preamble.sh"  # $OUT, START, the GPU's state; the carried wheels on the path
  bench=(--formats int4-all --layers 10)
  profile=(--formats int4-all --layers 10 --steps 20)
else
  OUT=${OUT:-/tmp/out}
  START=$(date +%s)
  export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
  mkdir -p "$OUT"
  bench=(--formats int4-all --tiny --device cpu)
  profile=(--formats int4-all --layers 2 --steps 3 --input-len 40 --device cpu)
fi
W=${LOGS:-/tmp/r12-logs}/$TAG
rm -rf "$W" && mkdir -p "$W"
pack() { tar czf "$OUT/$TAG.tgz" -C "$W" .; }
summary() { grep -E "passed|failed|skipped|FAILED|^ERROR|^E " "$1" | tail -8; }

if fits 170 "PDL tests"; then
  timeout 170 "$PYTHON" -m pytest -p no:cacheprovider -p no:benchmark --tb=short -rfEs \
    tests/kernels/test_pdl.py tests/backend/engine/test_pdl_decode_cuda.py tests/kernels/test_act_mul.py \
    > "$W/pytest-pdl.log" 2>&1
  echo "== PDL tests rc=$? at $(el)s"; summary "$W/pytest-pdl.log"
  pack
fi

PROFILE_S=${PROFILE_S:-130}  # kept for stage 3 (0: no profile)
R8_S=${R8_S:-0}  # > 0: stage 2b, the rank-of-8 profile, this budget (s)
C1_BUDGET=$(( LIMIT - $(el) - PROFILE_S - 50 ))  # 50: the process past its budget (a run cut, the record written)
C1_MAX=${C1_MAX:-160}; [ "$C1_BUDGET" -gt "$C1_MAX" ] && C1_BUDGET=$C1_MAX
if [ "$C1_BUDGET" -ge 90 ]; then
  timeout $(( C1_BUDGET + 50 )) "$PYTHON" -m benchmarks.cli engine decode-c1 "${bench[@]}" --rounds 3 --pdl-ab \
    --budget-s "$C1_BUDGET" --out "$W/decode-c1-pdl.json" > "$W/decode-c1-pdl.log" 2>&1
  echo "== decode-c1 --pdl-ab rc=$? at $(el)s (budget ${C1_BUDGET}s)"
  grep -E "^\| int4-all |^PDL on|^\`decode_c1" "$W/decode-c1-pdl.log" | sed 's/^/   /'
  pack
else
  echo "== skipped: decode-c1 (${C1_BUDGET}s of budget at $(el)s)"
fi

R8_LEFT=$(( LIMIT - $(el) - 5 ))
[ "$R8_S" -gt "$R8_LEFT" ] && R8_S=$R8_LEFT  # what the decode-c1 stage left
if [ "$R8_S" -ge 80 ] && [ "$TINY" = 0 ]; then
  timeout "$R8_S" "$PYTHON" -m lab.diagnostics.decode_c1_profile --formats int4-all --layers 78 --rank-of 8 \
    --steps 10 --pdl on,off --top 25 --out "$W/profile-rank-of-8.json" > "$W/profile-rank-of-8.log" 2>&1
  echo "== rank-of-8 profile rc=$? at $(el)s"; grep -v -E "Warning|warn|USDT|profiler" "$W/profile-rank-of-8.log" | head -56
  pack
fi

if [ "$PROFILE_S" -gt 0 ] && fits "$PROFILE_S" "profile"; then
  timeout "$PROFILE_S" "$PYTHON" -m lab.diagnostics.decode_c1_profile "${profile[@]}" --pdl on,off --top 12 \
    --out "$W/profile.json" > "$W/profile.log" 2>&1
  echo "== profile rc=$? at $(el)s"; grep -v -E "Warning|warn|USDT|profiler" "$W/profile.log" | head -30
  pack
fi

LEFT=$(( LIMIT - $(el) - 10 ))
if [ "$LEFT" -ge 60 ]; then
  timeout "$LEFT" "$PYTHON" -m pytest -p no:cacheprovider -p no:benchmark --tb=short -rfE -m gpu \
    tests/kernels/test_w4a16_gemm.py tests/kernels/test_fused_moe.py tests/kernels/test_rms_norm.py \
    tests/kernels/test_rope.py tests/kernels/test_router.py tests/kernels/test_kv_write_triton.py \
    tests/kernels/test_selection_triton.py tests/kernels/test_dsa_indexer_triton.py tests/kernels/test_mla_decode.py \
    tests/kernels/test_fp8_gemm.py tests/kernels/test_fused_moe_fp8.py > "$W/pytest-kernels.log" 2>&1
  echo "== kernel GPU tests (PDL on) rc=$? at $(el)s"; summary "$W/pytest-kernels.log"
  pack
else
  echo "== skipped: kernel GPU tests (${LEFT}s left)"
fi
echo "== done at $(el)s of ${LIMIT}s"
pack
