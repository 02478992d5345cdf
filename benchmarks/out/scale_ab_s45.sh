# session 45: bench_scale.py at 124M fp32, alternating processes: old = 5ec2e98, new = this session's code
cd /tmp
for i in 1 2 3 4; do
  for v in old new; do
    rm -rf /dev/shm/tmp* 2>/dev/null
    echo "== $v run $i"
    PYTHONPATH=/tmp/ab_$v OMP_NUM_THREADS=2 /work/main/.venv/bin/python /tmp/ab_$v/benchmarks/bench_scale.py --sizes 124M --json /tmp/s45/scale_ab_${v}_$i.json --plot /tmp/s45/scale_ab.png 2>&1 | grep -E "^\| 124M|^CPU seconds"
  done
done
