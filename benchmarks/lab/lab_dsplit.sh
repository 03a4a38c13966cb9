#!/usr/bin/env bash
# One device run of the DSplit lab: the tables (LAB_VARIANTS, LAB_SHAPES as
# lab_dsplit.py reads them), then ncu's stall reasons for the product, two of
# its stage variants and the read probe at a small and a large-N shape, under $OUT.
#   usage: benchmarks/lab/lab_dsplit.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvsplit-lab-out}
mkdir -p "$OUT"
nvidia-smi -q -d CLOCK,PERFORMANCE > "$OUT/smi.txt" 2>&1
python3 -P benchmarks/lab/lab_dsplit.py --out "$OUT" > "$OUT/lab_dsplit.log" 2>&1
tail -60 "$OUT/lab_dsplit.log"
# Duration, active cycles, instructions and every stall reason per issued instruction.
metrics="gpu__time_duration.sum,sm__cycles_active.avg,smsp__inst_executed.sum,smsp__warps_active.avg.per_cycle_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
profile() {  # $1: what, $2: kernel regex, then lab_dsplit.py's arguments
  echo "=== $1" >> "$OUT/ncu.txt"
  timeout 120 ncu --clock-control none --metrics "$metrics" -k "regex:$2" --launch-skip 1 \
    --launch-count 1 python3 -P benchmarks/lab/lab_dsplit.py "${@:3}" >> "$OUT/ncu.txt" 2>&1
}
for variant in product bare shell; do
  profile "$variant 128/32/16 P2xK4d4" dsplit --one "$variant" 128 32 16 2 4 4
done
profile "read 128/32/16" read_probe --read 128 32 16
profile "triton 128/32/16 4 warps" serial --triton 128 32 16 4
profile "product 128/32/264 P2xK32d8" dsplit --one product 128 32 264 2 32 8
profile "bare 128/32/264 P2xK32d8" dsplit --one bare 128 32 264 2 32 8
profile "read 128/32/264" read_probe --read 128 32 264
