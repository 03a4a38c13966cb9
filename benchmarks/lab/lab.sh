#!/usr/bin/env bash
# One device run of the kernel lab: clocks, the side-by-side table, ncu
# profiles of K = 1 (product and the lab's best guess) and the SASS of the
# variants, all under $OUT.   usage: benchmarks/lab/lab.sh [NCU_VARIANT]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvsplit-lab-out}
mkdir -p "$OUT"
other=${1:-unroll8}
nvidia-smi -q -d CLOCK,PERFORMANCE,POWER > "$OUT/smi.txt" 2>&1
python3 -P benchmarks/lab/lab.py --out "$OUT" 2>&1 | tee "$OUT/lab.log"
nvidia-smi -q -d CLOCK,PERFORMANCE >> "$OUT/smi.txt" 2>&1
for shape in "512 64 16" "512 2048 132"; do
  for variant in product "$other"; do
    echo "=== $variant $shape K=1" >> "$OUT/ncu.txt"
    timeout 90 ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy \
      --section LaunchStats --section InstructionStats -k regex:merge_kernel --launch-skip 1 \
      --launch-count 1 python3 -P benchmarks/lab/lab.py --one "$variant" $shape 1 >> "$OUT/ncu.txt" 2>&1 \
      || break 2  # no counters on this machine
  done
done
for so in /tmp/kvsplit-lab/product.so "/tmp/kvsplit-lab/${other//,/_}.so"; do
  echo "=== $so" >> "$OUT/sass.txt"
  cuobjdump --dump-sass "$so" >> "$OUT/sass.txt" 2>&1
done
gzip -f "$OUT/sass.txt"
