#!/bin/bash
# session 41: bench_chain 124M pure bf16 (weights and Adam moments stored in bf16), ten entries, restore_depth none / 3, alternating
cd /work/main
for i in 1; do
  for d in none 3; do
    echo "=== bf16 restore_depth $d run $i ($(date +%T))"
    extra=""; [ $d != none ] && extra="--restore-depth $d"
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_chain.py --dtype bfloat16 $extra --json /tmp/s41/ab/depth_bf16_${d}_$i.json --plot /tmp/s41/ab/depth_bf16_${d}_$i.png 2>&1 | grep -v loss_type
  done
done
