#!/usr/bin/env bash
# One device run of the DSplit lab: the tables, then ncu on the product's
# DSplit and the serial Triton peer at two shapes, under $OUT.
#   usage: benchmarks/lab/lab_dsplit.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvsplit-lab-out}
mkdir -p "$OUT"
nvidia-smi -q -d CLOCK,PERFORMANCE > "$OUT/smi.txt" 2>&1
python3 -P benchmarks/lab/lab_dsplit.py --out "$OUT" 2>&1 | tee "$OUT/lab_dsplit.log"
sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis"
for args in "product 512 64 16 8 4 8" "pack1 512 64 16 8 4 8" "product 128 32 264 2 64 8"; do
  echo "=== dsplit $args" >> "$OUT/ncu.txt"
  timeout 120 ncu --clock-control none $sections -k regex:dsplit --launch-skip 1 --launch-count 1 \
    python3 -P benchmarks/lab/lab_dsplit.py --one $args >> "$OUT/ncu.txt" 2>&1 || break
done
for args in "512 64 16 8" "128 32 264 4"; do
  echo "=== triton $args" >> "$OUT/ncu.txt"
  timeout 120 ncu --clock-control none $sections -k regex:serial --launch-skip 1 --launch-count 1 \
    python3 -P benchmarks/lab/lab_dsplit.py --triton $args >> "$OUT/ncu.txt" 2>&1 || break
done
