#!/usr/bin/env bash
# One device run: install the carried wheels, build kvsplit, run the GPU tests
# and the benchmarks, and leave every log under $OUT.
#   usage: benchmarks/gpu_check.sh [STAGE ...]
#   stages: build tests all-tests bench tune tune-adapters tune-coverage demo suites, or NAME for
#   benchmarks/NAME.py
#   (default: build tests bench). Carry .whl (benchmarks/fetch_wheels.sh fills it).
#   The tuning database of the run is $KVSPLIT_DB (default /tmp/kvsplit-tune.sqlite).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvsplit-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(build tests bench)

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/kv:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export KVSPLIT_DB=${KVSPLIT_DB:-sqlite:////tmp/kvsplit-tune.sqlite}
# Few files come back from $OUT (8 at most): logs go to one run.log.
LOG="$OUT/run.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >> "$LOG" 2>&1

status=0
for stage in "${stages[@]}"; do
  echo "=== $stage"
  case $stage in
    build)
      python3 -m pip install -v --no-build-isolation --no-deps --target /tmp/kv . \
        > /tmp/kvsplit-build.log 2>&1 || { tail -40 /tmp/kvsplit-build.log | tee -a "$LOG"; exit 1; }
      grep -E "warning|spill" /tmp/kvsplit-build.log | sort | uniq -c | head -20 | tee -a "$LOG"
      python3 -P -c "import kvsplit._ext as e; print('built', e.cuda_build_hash, e.cpu_build_hash, e.cuda_architectures)" ;;
    tests)
      python3 -P -m pytest tests -m gpu -q -p no:cacheprovider 2>&1 | tee -a "$LOG" | tail -25
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    all-tests)
      python3 -P -m pytest tests -q -p no:cacheprovider -n 8 2>&1 | tee -a "$LOG" | tail -25
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    tune)
      # The benchmark grid, both stats formats and 16-bit dtypes; exported for the package.
      python3 -P -m kvsplit tune --head-dim 512,128 --dtype bfloat16,float16 --format maxsum,lse \
        --num-splits 16,32,64,132,264 --rows 32,64,128,256,512,2048 2>&1 | tee -a "$LOG" | tail -15
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      python3 -P -m kvsplit db export --out "$OUT/tuned-h200.json"
      python3 -P -m kvsplit db stats 2>&1 | tee -a "$LOG"
      python3 -P -m kvsplit db list --head-dim 512 --dtype bfloat16 --stats-format maxsum >> "$LOG" 2>&1
      python3 -P -m kvsplit db plot --dtype bfloat16 --stats-format maxsum --out "$OUT/winners.png" 2>&1 | tail -2 ;;
    tune-adapters)
      # The engine adapters' shapes (kvsplit.compat), split-major and scattered-stats keys.
      python3 -P -m kvsplit tune --head-dim 512,128 --dtype bfloat16,float32 \
        --format lse,lse:scattered --num-splits 2,16,64,264 --rows 16,128,256,1024 \
        2>&1 | tee -a "$LOG" | tail -6
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      python3 -P -m kvsplit db export --out "$OUT/tuned-h200-adapters.json" ;;
    tune-coverage)
      # Head dims beyond the powers of two and FP8 outputs at the adapters' shapes, in a
      # database of their own (exported for the package as nvidia-h200-coverage.json).
      KVSPLIT_DB=sqlite:////tmp/kvsplit-coverage.sqlite python3 -P -m kvsplit tune \
        --head-dim 80,96,192,576 --dtype bfloat16 --out-dtype same,float8_e4m3fn \
        --format lse,lse:scattered --num-splits 2,16,64 --rows 16,128,1024 \
        2>&1 | tee -a "$LOG" | tail -6
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      KVSPLIT_DB=sqlite:////tmp/kvsplit-coverage.sqlite python3 -P -m kvsplit db export \
        --out "$OUT/tuned-h200-coverage.json" ;;
    demo)
      # The README's main job twice on a fresh database: the second process
      # must reuse the stored choice without profiling.
      for run in first second; do
        echo "--- demo, $run process" | tee -a "$LOG"
        KVSPLIT_DB=sqlite:////tmp/kvsplit-demo.sqlite python3 -P -m kvsplit demo 2>&1 | tee -a "$LOG"
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      done ;;
    suites)
      # The engines' own merge tests against kvsplit.compat (carry .suites: see
      # ../shared/engine-suites/README.md for how to assemble it).
      OUT=$OUT bash .suites/run_suites.sh 2>&1 | tee -a "$LOG" ;;
    bench)
      python3 -P benchmarks/bench_merge.py --out "$OUT" 2>&1 | tee -a "$LOG" | tail -45
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    *)
      script=$(ls "benchmarks/$stage.py" "benchmarks/$stage/$stage.py" 2>/dev/null | head -1)
      if [ -n "$script" ]; then
        python3 -P "$script" --out "$OUT" 2>&1 | tee -a "$LOG" | tail -40
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      else
        echo "unknown stage $stage"; status=1
      fi ;;
  esac
done
# The markdown tables of whatever benchmarks ran (docs/benchmarks.md is made of them).
if ls "$OUT"/bench_*.json >/dev/null 2>&1; then
  python3 benchmarks/report.py "$OUT" > "$OUT/report.md" || status=1
  cat "$OUT/report.md" >> "$LOG"
fi
exit $status
