#!/usr/bin/env bash
# Session 15's second H100/H200 call (after r15_validate.sh or r7_full_depth.sh), <= ~300 s:
# 1. the DSA top-k's resident kernel with 8-bit digits (4 rounds of tl.histogram) against the 4-bit
#    default: its GPU test, then `bench_selection --resident` (digits8_speedup per case; issue 24: the
#    1 x 2,176 row took 20.1 us, ~1.5 ms of the 10.1 ms rank-of-8 step). Follow-up: where digits8 wins
#    at 1 x 2,176, RESIDENT_DIGIT_BITS = 8 in kernels/selection_triton.py;
# 2. `lab.diagnostics.verify_rows_profile` (issue 28): which kernels grow from a plain step to a
#    verify over 2 and 4 rows at rank 0 of 8 (the projection's +40% a layer at k = 1);
# 3. the rank-of-8 c=1 step (int4-all, 78 layers) profiled with PDL OFF (issue 24): under PDL a kernel's
#    profiled time includes its wait on the one before (session 14's profile summed 23.9 ms of kernels in
#    a 10.8 ms step: _merge_kernel 36 us, _rope 12 us), so only PDL off says what each kernel costs.
#   run(command="timeout -s KILL 580 bash lab/device/r15_more.sh", carry=[".whl"], timeout_s=590)
source "$(dirname "$0")/preamble.sh"
W=/tmp/r15m && rm -rf $W && mkdir -p $W
pack() { tar czf "$OUT/r15_more.tgz" -C $W .; }
LIMIT=${LIMIT:-560}
timeout 120 python3 -m pytest -q -p no:cacheprovider -p no:benchmark --tb=short -rfE \
  tests/kernels/test_selection_triton.py > $W/selection_tests.log 2>&1
echo "== selection tests rc=$? at $(el)s"; grep -E "passed|failed|FAILED" $W/selection_tests.log | tail -5
timeout 90 python3 -m benchmarks.kernels.bench_selection --resident --out $W/resident.json > $W/resident.log 2>&1
echo "== bench_selection --resident rc=$? at $(el)s"; grep -E "resident|done" $W/resident.log | tail -6
pack
fits 170 "verify_rows_profile" && timeout 170 python3 -m lab.diagnostics.verify_rows_profile --depth 8 --out $W/verify_rows.json > $W/verify_rows.log 2>&1
echo "== verify_rows_profile rc=$? at $(el)s"; grep -v -i warn $W/verify_rows.log | grep -A28 "== growth" | head -30
grep "^== " $W/verify_rows.log | head -8
pack
fits 160 "PDL-off profile" && timeout 160 python3 -m lab.diagnostics.decode_c1_profile --formats int4-all \
  --layers 78 --rank-of 8 --pdl off --steps 10 --out $W/profile_pdl_off.json > $W/profile_pdl_off.log 2>&1
echo "== PDL-off profile rc=$? at $(el)s"; grep -v -i warn $W/profile_pdl_off.log | grep -A24 "^== " | head -26
pack
echo "== done at $(el)s"
