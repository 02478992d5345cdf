#!/bin/bash
# (base: a copy of the package at f68686a, new: with the allowance; fp32 run with REPS="1 2 3 4", bf16 with DTYPE=bfloat16 REPS="1 2 3")
# session 42: bench_scale 124M, today's trimming (main) against trimming only when the write's resident growth passes HELD_SHARE of the checkpoint (budget), alternating
D=${DTYPE:-float32}
for i in ${REPS:-1 2 3}; do
  for v in ${VARIANTS:-main budget}; do
    PP=/tmp/s42/$v
    echo "=== $v $D run $i ($(date +%T))"
    PYTHONPATH=$PP OMP_NUM_THREADS=2 /work/main/.venv/bin/python /work/main/benchmarks/bench_scale.py --sizes 124M --dtype $D --json /tmp/s42/ab_${v}_${D}_$i.json --plot /tmp/s42/ab_${v}_${D}_$i.png 2>&1 | grep -v loss_type | grep "^  124M"
  done
done
