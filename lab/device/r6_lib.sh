# Sourced by lab/device/r6_long.sh and r6_bench.sh (issue 25, session 6): the device preamble (the
# wheels, the GPU's state), the call's clock, and
#   scenario NAME BUDGET MIN ARGS...  one scenario in its own process, its budget cut to what is left
#                                     of LIMIT (skipped, said so, below MIN); record + log into $LOGS
#   left                              seconds left of LIMIT past the exit margin
#   archive                           everything in $LOGS into $OUT/$TAG.tgz (after every stage: what a
#                                     later overrun cannot take back)
# DRY=1 prints the commands instead (tests/benchmarks/test_r6_scripts.py parses them); TINY=1 runs the
# stage on the CPU at --tiny scale (PYTHON picks the interpreter). LIMIT: the call's seconds (540).
set -uo pipefail
OUT=${OUT:-/tmp/out}
PYTHON=${PYTHON:-python3}
TINY=${TINY:-0}
DRY=${DRY:-0}
LIMIT=${LIMIT:-540}
EXIT_S=20  # a scenario's process after its deadline: the run in flight cut, the record written
LOGS=${LOGS:-/tmp/r6-logs}/$TAG
if [ "$TINY" = 0 ] && [ "$DRY" = 0 ]; then
  source "$(dirname "${BASH_SOURCE[0]}")/preamble.sh"  # pip installs the carried wheels into /tmp/site
fi
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1

# DRY=1 prints the plan as if at the call's start (its budgets do not drift with this shell's clock)
left() { if [ "$DRY" = 1 ]; then echo $((LIMIT - EXIT_S)); else echo $((LIMIT - SECONDS - EXIT_S)); fi; }

archive() { [ "$DRY" = 1 ] || tar -czf "$OUT/$TAG.tgz" -C "$LOGS" .; }

scenario() {
  local name=$1 budget=$2 min=$3 now
  shift 3
  now=$(left)
  [ "$budget" -gt "$now" ] && budget=$now
  if [ "$budget" -lt "$min" ]; then
    echo "== $name: skipped, ${now}s left of the call (it needs ${min}s)"
    return
  fi
  local cmd=("$PYTHON" -m benchmarks.cli engine scenario "$name" "$@" --budget-s "$budget" --out "$LOGS/$name.json")
  if [ "$DRY" = 1 ]; then
    echo "${cmd[*]}"
    return
  fi
  timeout $((budget + 45)) "${cmd[@]}" > "$LOGS/$name.log" 2>&1
  echo "== $name rc=$? at ${SECONDS}s (budget ${budget}s)"
  grep -E "^\| $name \||^Beside|^Warm-up|^No warm-up|^Decode graphs|^\| [0-9]+ \| [AB] \|" "$LOGS/$name.log" \
    | sed 's/ | not measured here.*//'
  archive
}
