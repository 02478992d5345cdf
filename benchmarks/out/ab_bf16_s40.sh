#!/bin/bash
# session 40 A/B: bench_chain at 124M pure bf16, old (c5ac5dd) and new (the gap coding) alternating, one pair
cd /tmp/s40
for v in old new; do
  echo "=== $v ($(date +%T))"
  PYTHONPATH=/tmp/s40/$v /work/main/.venv/bin/python /work/main/benchmarks/bench_chain.py --dtype bfloat16 --json /tmp/s40/chainbf_${v}.json --plot /tmp/s40/chainbf_${v}.png 2>&1 | grep -v loss_type
done
