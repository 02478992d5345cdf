#!/bin/bash
# session 43: bench_scale 124M, a copy of the package with the compiled varints (c617328, "new") against one that also groups past 12 groups in two passes ("two"), alternating
D=${DTYPE:-float32}
for i in ${REPS:-1 2 3}; do
  for v in new two; do
    echo "=== $v $D run $i ($(date +%T))"
    PYTHONPATH=/tmp/ab_$v OMP_NUM_THREADS=2 /work/main/.venv/bin/python /work/main/benchmarks/bench_scale.py --sizes 124M --dtype $D --json /tmp/s43/ab2_${v}_${D}_$i.json --plot /tmp/s43/ab2_${v}_${D}_$i.png 2>&1 | grep -v loss_type | grep "^  124M"
  done
done
