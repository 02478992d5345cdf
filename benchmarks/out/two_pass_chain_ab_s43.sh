#!/bin/bash
# session 43: bench_chain 124M fp32 (ten entries, each restored in chain order), a copy of the package at f6e2588 (one-pass undoing, "two") against one that also undoes past 12 groups in two passes ("inv"), alternating
for i in ${REPS:-1 2}; do
  for v in two inv; do
    echo "=== $v run $i ($(date +%T))"
    PYTHONPATH=/tmp/ab_$v OMP_NUM_THREADS=2 /work/main/.venv/bin/python /work/main/benchmarks/bench_chain.py --json /tmp/s43/chain_${v}_$i.json --plot /tmp/s43/chain_${v}_$i.png 2>&1 | grep -v loss_type | tail -12
  done
done
