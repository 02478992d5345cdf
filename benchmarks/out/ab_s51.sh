#!/bin/bash
# usage: ab_s51.sh N extra-args...; alternates A (HEAD) and B (change) bench_scale 124M runs
N=$1; shift
for i in $(seq $N); do for v in ${VARIANTS:-A B}; do
  rm -rf /dev/shm/tmp*; echo -n "$v: "
  (cd ${ABDIR:-/tmp/s51}/$v && OMP_NUM_THREADS=2 PYTHONPATH=${ABDIR:-/tmp/s51}/$v /work/main/.venv/bin/python ${ABDIR:-/tmp/s51}/$v/benchmarks/bench_scale.py --sizes 124M "$@" 2>&1 | grep -E "^. 124M|^CPU seconds" | cut -c1-400)
done; done
