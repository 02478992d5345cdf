# session 41: bench_scale 124M with ReleaseFreed (core/memory.py) trimming every 2^23 values (t23, today), 2^25 (t25), 2^27 (t27), only at the end of a write (tinf), or every 2^23 values only when mallinfo2().fordblks is over 128 / 512 MB (tf128 / tf512); each variant a copy of the package with that one change
#!/bin/bash
# session 41: bench_scale 124M with ReleaseFreed trimming every 2^23 (today), 2^25, 2^27 values, or only at the end of a write (tinf), alternating
D=${DTYPE:-float32}
for i in ${REPS:-1 2 3}; do
  for v in ${VARIANTS:-t23 t25 t27 tinf}; do
    echo "=== $v $D run $i ($(date +%T))"
    PYTHONPATH=/tmp/s41/$v OMP_NUM_THREADS=2 /work/main/.venv/bin/python /work/main/benchmarks/bench_scale.py --sizes 124M --dtype $D --json /tmp/s41/trim_${v}_${D}_$i.json --plot /tmp/s41/trim_${v}_${D}_$i.png 2>&1 | grep -v loss_type | grep "^  124M"
  done
done
