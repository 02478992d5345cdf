#!/bin/bash
# session 41: bench_chain 350M fp32, ten entries, restore_depth none / 3, alternating
cd /work/main
for i in 1; do
  for d in none 3; do
    echo "=== 350M fp32 restore_depth $d run $i ($(date +%T))"
    extra=""; [ $d != none ] && extra="--restore-depth $d"
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_chain.py --size 350M $extra --json /tmp/s41/ab/depth_350M_${d}_$i.json --plot /tmp/s41/ab/depth_350M_${d}_$i.png 2>&1 | grep -v loss_type
  done
done
