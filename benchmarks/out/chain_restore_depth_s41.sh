#!/bin/bash
# session 41: bench_chain 124M fp32, ten entries, restore_depth none / 3 / 2 (the code under test), one process each
cd /work/main
for i in 1 2; do
  for d in none 3 2; do
    echo "=== restore_depth $d run $i ($(date +%T))"
    extra=""; [ $d != none ] && extra="--restore-depth $d"
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_chain.py $extra --json /tmp/s41/ab/depth_${d}_$i.json --plot /tmp/s41/ab/depth_${d}_$i.png 2>&1 | grep -v loss_type
  done
done
