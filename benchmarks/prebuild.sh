#!/usr/bin/env bash
# Builds on this machine (nvcc, no GPU needed) what benchmarks/gpu_check.sh would
# otherwise compile on the device, for the device's Python (3.12 by default):
#   .kvbuild/kv.tar.xz  the source build (sm_90a machine code, kvsplit._bench included),
#                    compressed (a sixth of its 46 MB: a run's files travel within 64 MiB)
#   .kvbuild/ptx80   the PTX-only build (compute_80) for the ptx80 stage
#   .kvbuild/dist    the binary wheel (packaging/build_wheel.sh), with --wheel
# Carry .kvbuild (ignored by git); `echo /.kvbuild/ >> .git/info/exclude` once.
#   usage: benchmarks/prebuild.sh [--python PY] [--wheel]
set -euo pipefail
cd "$(dirname "$0")/.."
py=python3.12 wheel=0
while [ $# -gt 0 ]; do
  case $1 in
    --python) py=$2; shift ;;
    --wheel) wheel=1 ;;
    *) echo "prebuild.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
command -v "$py" >/dev/null || { echo "prebuild.sh: no $py (give the device's Python with --python)" >&2; exit 2; }
"$py" -c "import scikit_build_core, pybind11" 2>/dev/null ||
  "$py" -m pip install -q scikit-build-core pybind11 cmake ninja
rm -rf .kvbuild/kv .kvbuild/kv.tar.xz .kvbuild/ptx80
"$py" -m pip install -q --no-build-isolation --no-deps --target .kvbuild/kv \
  -C build-dir=build/prebuild-kv .
CUDAARCHS=80-virtual "$py" -m pip install -q --no-build-isolation --no-deps \
  --target .kvbuild/ptx80 -C build-dir=build/prebuild-ptx80 .
if [ $wheel -eq 1 ]; then
  rm -rf .kvbuild/dist
  packaging/build_wheel.sh --no-isolation --python "$py" --out .kvbuild/dist
fi
tar cJf .kvbuild/kv.tar.xz --exclude=__pycache__ -C .kvbuild/kv . && rm -rf .kvbuild/kv
git describe --always --dirty > .kvbuild/SOURCE
du -sh .kvbuild/*; echo "source: $(cat .kvbuild/SOURCE)"
