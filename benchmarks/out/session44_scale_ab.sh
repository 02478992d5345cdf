cd /tmp
for i in 1 2 3 4; do
  for v in old new; do
    rm -rf /dev/shm/tmp* 2>/dev/null
    echo "== $v $i"
    PYTHONPATH=/tmp/ab_$v OMP_NUM_THREADS=2 /work/main/.venv/bin/python /tmp/ab_$v/benchmarks/bench_scale.py --sizes 124M --plot /tmp/s44/scale_$v.png 2>&1 | grep -E "^  124M (torch|keyframe|delta|restore|save after)"
  done
done
