#!/usr/bin/env bash
# One device run: install the carried wheels, build kvsplit, run the GPU tests
# and the benchmarks, and leave every log under $OUT.
#   usage: benchmarks/gpu_check.sh [STAGE ...]
#   stages: build tests all-tests few-tests bench bench_few lab_few tune tune-adapters
#   tune-coverage against-base demo suites ptx80 wheel-build wheel, or NAME for benchmarks/NAME.py
#   (or benchmarks/lab/NAME.py), or base:NAME for that benchmark with another commit's build
#   (.kvbuild/$BASE_DIR, as against-base takes it) and a database of its own, into $OUT/base
#   (default: build tests bench). Carry .whl (benchmarks/fetch_wheels.sh fills it).
#   GPU_CHECK_BUDGET_S: the seconds the run may take (a device call's limit less its start and
#   transfers). A stage starts only with GPU_CHECK_STAGE_MIN_S (default 60) of them left, and
#   its long commands stop when they run out, so that the logs and the report still come back;
#   the last line names the stages skipped or stopped.
#   ptx80: a build whose only CUDA code is PTX for compute_80 (the driver compiles it for
#   this GPU) runs the GPU tests. wheel-build: packaging/build_wheel.sh for this machine's
#   Python into /tmp/kvsplit-dist. wheel: installs that wheel (or $KVSPLIT_WHEEL) into a
#   fresh venv with pip --no-deps, no compiler on PATH, and runs the GPU tests and the demo.
#   TUNE_TIMEOUT_S bounds each tune stage's tuner (resumable; what it stored is exported).
#   The tuning database of the run is $KVSPLIT_DB (default /tmp/kvsplit-tune.sqlite); the tune
#   stages each write one of their own, whose export holds their grid's keys alone.
#   Builds made elsewhere save device time: with .kvbuild/kv (or kv.tar.xz, its contents
#   compressed: a sixth of the size) and .kvbuild/ptx80 carried, `pip install --target` trees
#   of this commit for the device's Python, build and ptx80 take them instead of compiling
#   (benchmarks/prebuild.sh makes them on a machine with nvcc).
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
run_db=$KVSPLIT_DB
# Few files come back from $OUT (8 at most): logs go to one run.log.
LOG="$OUT/run.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >> "$LOG" 2>&1
# The GPU as the shipped tables' names spell it ("NVIDIA H100 80GB HBM3" -> nvidia-h100).
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | awk '{print tolower($1 "-" $2)}')
gpu=${gpu:-unknown-gpu}

budget=${GPU_CHECK_BUDGET_S:-0} started=$(date +%s)
cut_short=$(mktemp)  # the stages whose commands ran out of the budget (bounded runs in pipelines)
left() { echo $(( budget - ($(date +%s) - started) )); }
# "$@" within the run's budget, 10 s of it kept for the report.
bounded() {
  [ "$budget" -gt 0 ] || { "$@"; return; }
  local seconds=$(( $(left) - 10 )) rc
  [ "$seconds" -gt 0 ] || seconds=1
  timeout --kill-after=5 "$seconds" "$@"; rc=$?
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && { echo "stopped: $1 reached GPU_CHECK_BUDGET_S"; echo "$stage" >> "$cut_short"; }
  return $rc
}
# The tree of another commit's build in /tmp/kv-base: .kvbuild/$BASE_DIR/kv.tar.xz (a whole
# `pip install --target` tree), or its extension alone (_ext*.so or .so.xz) in this build's tree.
base_tree() {
  local base_dir=.kvbuild/${BASE_DIR:-base} base_ext
  base_ext=$(ls "$base_dir"/_ext*.so "$base_dir"/_ext*.so.xz 2>/dev/null | head -1)
  rm -rf /tmp/kv-base
  if [ -f "$base_dir/kv.tar.xz" ]; then
    mkdir -p /tmp/kv-base && tar xJf "$base_dir/kv.tar.xz" -C /tmp/kv-base
  elif [ -n "$base_ext" ]; then
    cp -r /tmp/kv /tmp/kv-base &&
      python3 -c "import lzma, shutil, sys; src, dst = sys.argv[1:]; \
shutil.copyfileobj((lzma.open if src.endswith('.xz') else open)(src, 'rb'), open(dst, 'wb'))" \
        "$base_ext" "/tmp/kv-base/kvsplit/$(basename "${base_ext%.xz}")"
  else
    echo "no $base_dir/_ext*.so or kv.tar.xz" | tee -a "$LOG"; return 1
  fi
}
# benchmarks/NAME.py (or benchmarks/NAME/NAME.py, benchmarks/lab/NAME.py).
bench_script() {
  ls "benchmarks/$1.py" "benchmarks/$1/$1.py" "benchmarks/lab/$1.py" 2>/dev/null | head -1
}

status=0 skipped=()
for stage in "${stages[@]}"; do
  if [ "$budget" -gt 0 ] && [ "$(left)" -lt "${GPU_CHECK_STAGE_MIN_S:-60}" ]; then
    echo "=== $stage skipped: $(left) s left of GPU_CHECK_BUDGET_S=$budget" | tee -a "$LOG"
    skipped+=("$stage"); continue
  fi
  echo "=== $stage ($(date +%T))" | tee -a "$LOG"
  case $stage in
    build)
      if [ -d .kvbuild/kv ]; then
        rm -rf /tmp/kv && cp -r .kvbuild/kv /tmp/kv && echo "prebuilt: .kvbuild/kv of $(cat .kvbuild/SOURCE 2>/dev/null)" | tee -a "$LOG"
      elif [ -f .kvbuild/kv.tar.xz ]; then
        rm -rf /tmp/kv && mkdir -p /tmp/kv && tar xJf .kvbuild/kv.tar.xz -C /tmp/kv &&
          echo "prebuilt: .kvbuild/kv.tar.xz of $(cat .kvbuild/SOURCE 2>/dev/null)" | tee -a "$LOG"
      else
        python3 -m pip install -v --no-build-isolation --no-deps --target /tmp/kv . \
          > /tmp/kvsplit-build.log 2>&1 || { tail -40 /tmp/kvsplit-build.log | tee -a "$LOG"; exit 1; }
        grep -E "warning|spill" /tmp/kvsplit-build.log | sort | uniq -c | head -20 | tee -a "$LOG"
      fi
      # A tree that lost its Python files still imports kvsplit._ext (as a namespace package).
      python3 -P -c "import kvsplit, kvsplit._ext as e; assert kvsplit.__file__, 'no kvsplit/__init__.py'; \
print('built', kvsplit.__file__, e.cuda_build_hash, e.cpu_build_hash, e.cuda_architectures)" ||
        { echo "build: kvsplit does not import whole from /tmp/kv (carry .kvbuild/kv again)" | tee -a "$LOG"; exit 1; } ;;
    tests)
      bounded python3 -P -m pytest tests -m gpu -q -p no:cacheprovider 2>&1 | tee -a "$LOG" | tail -25
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    few-tests)
      # The Few family's GPU tests and the peers it is measured against (a subset of tests).
      bounded python3 -P -m pytest -m gpu -q -p no:cacheprovider tests/test_merge_few.py \
        tests/test_peer_kernels.py tests/test_merge_coverage.py tests/test_merge_extremes.py \
        tests/test_pdl.py tests/test_merge.py::test_cuda_graph_capture_and_replay \
        2>&1 | tee -a "$LOG" | tail -25
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    bench_few)
      # Few states: N = 2, 4, 8, 16 next to the engines' designs and the read probe (each key
      # tuned into $KVSPLIT_DB first; its table is also in report.md).
      bounded python3 -P benchmarks/bench_few.py --out "$OUT" ${BENCH_FEW_ARGS:-} 2>&1 | tee -a "$LOG" | tail -90
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    lab_few)
      # The Few kernel's knobs (CTA sizes, registers) side by side (LAB_VARIANTS to pick).
      bounded python3 -P benchmarks/lab/lab_few.py --out "$OUT" 2>&1 | tee -a "$LOG" | tail -20
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    all-tests)
      bounded python3 -P -m pytest tests -q -p no:cacheprovider -n 8 2>&1 | tee -a "$LOG" | tail -25
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    tune)
      # The benchmark grid, both stats formats and 16-bit dtypes, in a database of its own
      # (its export holds the grid's keys alone: kvsplit/tables/$gpu.json).
      export KVSPLIT_DB=sqlite:////tmp/kvsplit-grid.sqlite
      bounded timeout "${TUNE_TIMEOUT_S:-0}" python3 -P -m kvsplit tune --head-dim 512,128 --dtype bfloat16,float16 --format maxsum,lse \
        --num-splits 16,32,64,132,264 --rows 32,64,128,256,512,2048 2>&1 | tee -a "$LOG" | tail -15
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      python3 -P -m kvsplit db export --out "$OUT/$gpu.json"
      python3 -P -m kvsplit db stats 2>&1 | tee -a "$LOG"
      python3 -P -m kvsplit db list --head-dim 512 --dtype bfloat16 --stats-format maxsum >> "$LOG" 2>&1
      python3 -P -m kvsplit db plot --dtype bfloat16 --stats-format maxsum --out "$OUT/winners.png" 2>&1 | tail -2
      export KVSPLIT_DB=$run_db ;;
    tune-adapters)
      # The engine adapters' shapes (kvsplit.compat), split-major and scattered-stats keys, in
      # a database of their own ($gpu-adapters.json).
      KVSPLIT_DB=sqlite:////tmp/kvsplit-adapters.sqlite bounded timeout "${TUNE_TIMEOUT_S:-0}" python3 -P -m kvsplit tune \
        --head-dim 512,128 --dtype bfloat16,float32 \
        --format lse,lse:scattered --num-splits 2,16,64,264 --rows 16,128,256,1024 \
        2>&1 | tee -a "$LOG" | tail -6
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      KVSPLIT_DB=sqlite:////tmp/kvsplit-adapters.sqlite python3 -P -m kvsplit db export \
        --out "$OUT/$gpu-adapters.json" ;;
    tune-coverage)
      # Head dims beyond the powers of two, float32 and FP8 outputs at the adapters' shapes, in a
      # database of their own (exported for the package as $gpu-coverage.json).
      KVSPLIT_DB=sqlite:////tmp/kvsplit-coverage.sqlite bounded timeout "${TUNE_TIMEOUT_S:-0}" python3 -P -m kvsplit tune \
        --head-dim 80,96,192,576 --dtype bfloat16 --out-dtype same,float32,float8_e4m3fn \
        --format lse,lse:scattered --num-splits 2,16,64 --rows 16,128,1024 \
        2>&1 | tee -a "$LOG" | tail -6
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      KVSPLIT_DB=sqlite:////tmp/kvsplit-coverage.sqlite python3 -P -m kvsplit db export \
        --out "$OUT/$gpu-coverage.json" ;;
    against-base)
      # This build against another: carry its extension as .kvbuild/base/_ext*.so (or .so.xz;
      # e.g. a build of the last commit, run with this tree's Python), or a whole
      # `pip install --target` tree of another commit as .kvbuild/base/kv.tar.xz (its own
      # Python and tuner). The same grid is tuned BASE_PASSES times with each, the builds
      # alternating, then every candidate timed by both is compared (compare_records.py).
      # BASE_DIR names another folder of .kvbuild than base (its report: against_BASE_DIR.md).
      rm -f /tmp/against-*.json
      base_tree || { status=1; continue; }
      for pass in $(seq "${BASE_PASSES:-3}"); do
        for build in base new; do
          tree=/tmp/kv; [ $build = base ] && tree=/tmp/kv-base
          db=sqlite:////tmp/kvsplit-$build-$pass.sqlite
          rm -f "/tmp/kvsplit-$build-$pass.sqlite"
          PYTHONPATH=$tree:/tmp/site KVSPLIT_DB=$db bounded python3 -P -m kvsplit tune \
            ${BASE_GRID:---head-dim 128,512 --dtype bfloat16 --format maxsum,lse --num-splits 16,32,64,132 --rows 32,64,128,256,2048} \
            > /tmp/kvsplit-$build-$pass.log 2>&1 || { tail -5 /tmp/kvsplit-$build-$pass.log | tee -a "$LOG"; status=1; }
          PYTHONPATH=$tree:/tmp/site KVSPLIT_DB=$db python3 -P -m kvsplit db export \
            --out /tmp/against-$build-$pass.json > /dev/null
        done
      done
      PYTHONPATH=/tmp/kv-base:/tmp/site python3 -P -c "import kvsplit._ext as e; print('base build', e.cuda_build_hash)" | tee -a "$LOG"
      python3 -P benchmarks/compare_records.py --base /tmp/against-base-*.json --new /tmp/against-new-*.json \
        2>&1 | tee -a "$LOG" "$OUT/against_${BASE_DIR:-base}.md" ;;
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
      OUT=$OUT bounded bash .suites/run_suites.sh 2>&1 | tee -a "$LOG" ;;
    ptx80)
      # The proof without the other GPUs: no machine code at all, so every kernel this GPU
      # runs is the driver's compilation of the compute_80 PTX (no sm_90 instructions).
      export CUDA_CACHE_MAXSIZE=$((4 << 30))  # each kernel JIT-compiled once for the suite
      if [ -d .kvbuild/ptx80 ]; then
        rm -rf /tmp/kv-ptx80 && cp -r .kvbuild/ptx80 /tmp/kv-ptx80
      else
        CUDAARCHS=80-virtual python3 -m pip install -v --no-build-isolation --no-deps --upgrade \
          --target /tmp/kv-ptx80 -C build-dir=build/ptx80 . > /tmp/kvsplit-ptx80.log 2>&1 ||
          { tail -40 /tmp/kvsplit-ptx80.log | tee -a "$LOG"; status=1; continue; }
      fi
      PYTHONPATH=/tmp/kv-ptx80:/tmp/site python3 -P -c "import kvsplit._ext as e; \
assert e.cuda_architectures == '80-virtual', e.cuda_architectures; \
print('ptx80 build', e.cuda_build_hash, e.cuda_architectures)" 2>&1 | tee -a "$LOG"
      PYTHONPATH=/tmp/kv-ptx80:/tmp/site bounded python3 -P -m pytest tests -m gpu -q -p no:cacheprovider \
        2>&1 | tee -a "$LOG" | tail -25
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    wheel-build)
      # The binary wheel for this machine's Python, every architecture, tagged
      # manylinux_2_28_x86_64 by the auditwheel that .whl carries.
      start=$(date +%s)
      packaging/build_wheel.sh --no-isolation --out /tmp/kvsplit-dist > /tmp/kvsplit-wheel.log 2>&1 ||
        { tail -40 /tmp/kvsplit-wheel.log | tee -a "$LOG"; status=1; continue; }
      grep -E "^(nvcc|architectures|built in|---|NEEDED|newest|  machine code|  PTX|wheel:|no auditwheel)" \
        /tmp/kvsplit-wheel.log | tee -a "$LOG"
      echo "wheel-build: $(($(date +%s) - start)) s on $(nproc) cores" | tee -a "$LOG" ;;
    wheel)
      # What a user gets: the wheel in a fresh venv (this machine's torch through a .pth file),
      # pip --no-deps --no-index --only-binary, no nvcc on PATH; then info, the GPU tests and
      # the demo from it, never from the source tree.
      wheel=${KVSPLIT_WHEEL:-$(ls /tmp/kvsplit-dist/kvsplit-*.whl .kvbuild/dist/kvsplit-*.whl 2>/dev/null | head -1)}
      [ -n "$wheel" ] || { echo "wheel: no wheel (run wheel-build, or set KVSPLIT_WHEEL)" |
        tee -a "$LOG"; status=1; continue; }
      venv=/tmp/kvsplit-wheel-venv host_python=$(command -v python3)
      rm -rf "$venv"
      python3 -m venv --without-pip "$venv" || { status=1; continue; }
      site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
      python3 -c "import site; print('\n'.join(site.getsitepackages()))" > "$site/base-site.pth"
      (
        export PATH=$venv/bin:/usr/bin:/bin PYTHONPATH=/tmp/site
        unset CUDACXX CUDA_HOME
        echo "--- $(basename "$wheel") into $venv; nvcc on PATH: $(command -v nvcc || echo none)"
        "$host_python" -m pip install -q --no-deps --no-index --only-binary=:all: --target "$site" \
          "$wheel" || exit 1
        python -P -c "import kvsplit, kvsplit._ext as e; \
assert kvsplit.__file__.startswith('$venv'), kvsplit.__file__; \
print('from the wheel:', kvsplit.__file__, e.cuda_architectures)" || exit 1
        python -P -m kvsplit info || exit 1
        python -P -m pytest tests -m gpu -q -p no:cacheprovider 2>&1 | tail -25
        [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
        KVSPLIT_DB=sqlite:////tmp/kvsplit-wheel-demo.sqlite python -P -m kvsplit demo
      ) 2>&1 | tee -a "$LOG"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    bench)
      bounded python3 -P benchmarks/bench_merge.py --out "$OUT" 2>&1 | tee -a "$LOG" | tail -45
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    base:*)
      # The other build's side of a benchmark (this build's: the same stage without base:),
      # its results and report under $OUT/base.
      script=$(bench_script "${stage#base:}")
      [ -n "$script" ] || { echo "unknown stage $stage" | tee -a "$LOG"; status=1; continue; }
      base_tree || { status=1; continue; }
      mkdir -p "$OUT/base"
      PYTHONPATH=/tmp/kv-base:/tmp/site${PYTHONPATH#/tmp/kv:/tmp/site} \
        KVSPLIT_DB=sqlite:////tmp/kvsplit-base.sqlite bounded python3 -P "$script" --out "$OUT/base" \
        2>&1 | tee -a "$LOG" | tail -40
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      PYTHONPATH=/tmp/kv-base:/tmp/site python3 -P -c "import kvsplit._ext as e; print('base build', e.cuda_build_hash)" | tee -a "$LOG" ;;
    *)
      script=$(bench_script "$stage")
      if [ -n "$script" ]; then
        bounded python3 -P "$script" --out "$OUT" 2>&1 | tee -a "$LOG" | tail -40
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      else
        echo "unknown stage $stage" | tee -a "$LOG"; status=1
      fi ;;
  esac
done
# The markdown tables of whatever benchmarks ran (docs/benchmarks.md is made of them).
if ls "$OUT"/bench_*.json >/dev/null 2>&1; then
  python3 benchmarks/report.py "$OUT" > "$OUT/report.md" || status=1
  cat "$OUT/report.md" >> "$LOG"
fi
if ls "$OUT"/base/bench_*.json >/dev/null 2>&1; then
  python3 benchmarks/report.py "$OUT/base" > "$OUT/report_base.md" || status=1
fi
[ ${#skipped[@]} -eq 0 ] || echo "skipped (GPU_CHECK_BUDGET_S): ${skipped[*]}" | tee -a "$LOG"
[ -s "$cut_short" ] && echo "stopped at GPU_CHECK_BUDGET_S: $(sort -u "$cut_short" | tr '\n' ' ')" | tee -a "$LOG"
echo "=== end ($(date +%T)), status $status" | tee -a "$LOG"
exit $status
