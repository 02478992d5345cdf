#!/bin/bash
# session 40 A/B: bench_chain at 124M fp32, old (c5ac5dd) and new (a prototype, or the gap coding) copied to /tmp/s40/{old,new} alternating
cd /tmp/s40
for i in 1 2; do
  for v in old new; do
    echo "=== $v run $i ($(date +%T))"
    PYTHONPATH=/tmp/s40/$v /work/main/.venv/bin/python -c "import hf_dynaquant, sys; print(hf_dynaquant.__file__)"
    PYTHONPATH=/tmp/s40/$v /work/main/.venv/bin/python /work/main/benchmarks/bench_chain.py --json /tmp/s40/chain_${v}_$i.json --plot /tmp/s40/chain_${v}_$i.png 2>&1 | grep -v loss_type
  done
done
