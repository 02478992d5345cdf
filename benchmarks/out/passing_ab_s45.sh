cd /tmp
for i in 1 2 3 4 5; do
  for v in old unl new; do
    rm -rf /dev/shm/tmp* 2>/dev/null
    EXPECT=/tmp/ab_$v PYTHONPATH=/tmp/ab_$v OMP_NUM_THREADS=2 /work/main/.venv/bin/python /work/main/benchmarks/out/packed_base_deltas_s44.py 2>&1 | grep -v loss_type
  done
done
