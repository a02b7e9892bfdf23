#!/usr/bin/env bash
set -u
target/gpu/cuda-tests --test-threads=1 > $OUT/tests.txt 2>&1; echo "tests rc=$?"; grep -E "test result|FAILED|panicked" $OUT/tests.txt | head
for i in 1 2; do target/gpu/lily bench --synthetic --quant q4 --prompt 4096 --gen 16 2>&1 | grep -E "^prefill"; done
NCU=/usr/local/cuda/bin/ncu
$NCU --profile-from-start off --clock-control none -k regex:'moe_group|gemm_q' --launch-skip 0 --launch-count 12 \
  target/gpu/lily bench --synthetic --quant q4 --prompt 2048 --gen 2 --no-graphs > $OUT/ncu.txt 2>&1
grep -E "^  [a-z_]+ \(|Duration" $OUT/ncu.txt
