#!/bin/bash
# session 40 A/B: bench_scale at 124M fp32, old (c5ac5dd) and new (the gap coding) copied to /tmp/s40/{old,new} alternating (runs 1-2, 3-6, then 7-9)
cd /tmp/s40
for i in 1 2; do  # (then again as runs 3-6 and 7-9)
  for v in old new; do
    echo "=== $v run $i ($(date +%T))"
    PYTHONPATH=/tmp/s40/$v /work/main/.venv/bin/python /work/main/benchmarks/bench_scale.py --sizes 124M --json /tmp/s40/scale_${v}_$i.json --plot /tmp/s40/scale_${v}_$i.png 2>&1 | grep -v loss_type
  done
done
