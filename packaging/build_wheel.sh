#!/usr/bin/env bash
# kvsplit's binary wheel: CUDA kernels as machine code for every current NVIDIA
# data-centre and workstation GPU family plus PTX for the newest, the CUDA
# runtime linked statically, no benchmark kernels, no torch C++ dependency.
#
#   usage: packaging/build_wheel.sh [--check] [--out DIR] [--python PY]... [--no-isolation]
#          packaging/build_wheel.sh --inspect WHEEL...
#
#   --check         configure only (seconds): nvcc knows every architecture and
#                   the wheel's CMake configuration is valid; builds nothing
#   --inspect       only the checks below, of wheels built before
#   --out DIR       where the wheels go (default: dist/)
#   --python PY     an interpreter to build for (repeatable). Default: inside
#                   quay.io/pypa/manylinux_2_28_x86_64 (AUDITWHEEL_PLAT set)
#                   every /opt/python/cp31[0-4]-*; elsewhere python3
#   --no-isolation  build with the interpreter's own scikit-build-core and
#                   pybind11 (pip's --no-build-isolation) instead of fetching them
#
# Environment: CUDAARCHS overrides the architectures below; CUDACXX (or nvcc on
# PATH, or /usr/local/cuda/bin/nvcc) is the compiler. Needs CUDA 12.9 or later
# (sm_103a); the driver floor of the wheel is that of its CUDA major version
# (CUDA 13: driver 580 or newer, README "Installing for GPUs").
#
# After each build the wheel is checked: its size (PyPI's default limit is
# 100 MB), no kvsplit._bench, no shared-library dependency on torch, c10 or the
# CUDA runtime, machine code for each architecture (cuobjdump --list-elf, when
# cuobjdump is found), PTX for the newest (--list-ptx), and what sets the tag.
#
# The platform tag: manylinux_2_28_x86_64 (glibc 2.28 and later: RHEL 8, Ubuntu
# 20.04, Debian 11) from any x86_64 Linux host, no manylinux image needed. The
# wheel's CMake option KVSPLIT_OLDEST_GLIBC=2.28 links _ext against stand-ins
# for the C library that carry only glibc 2.28's symbol versions
# (packaging/glibc_stubs.py makes them from the host's own glibc, which keeps
# every old version), links libstdc++ in, and defines locally the few symbols
# of a newer glibc that libstdc++ uses (packaging/glibc_compat.cpp). The checks
# refuse a _ext that needs a symbol version past GLIBC_2.28, any libstdc++
# version, or a C library symbol without a version. auditwheel then writes the
# tag (AUDITWHEEL_PLAT overrides it): the command on PATH or beside nvcc, or
# the module of a build's Python (benchmarks/fetch_wheels.sh carries it to a
# machine without network). Without auditwheel the wheel keeps the plain
# linux_x86_64 tag, which PyPI refuses.
set -euo pipefail
cd "$(dirname "$0")/.."

# sm_80 A100, A30 · sm_86 A10, A40, RTX 30 · sm_89 L4, L40, RTX 40 · sm_90a H100, H200 ·
# sm_100a B200, GB200 · sm_103a B300, GB300 · sm_120 RTX PRO 6000, RTX 50 ·
# compute_120 PTX: GPUs newer than all of them (the driver compiles it).
ARCHS=${CUDAARCHS:-"80-real;86-real;89-real;90a-real;100a-real;103a-real;120-real;120-virtual"}
MAX_WHEEL_BYTES=$((100 * 1000 * 1000))
OLDEST_GLIBC=2.28
PLAT=${AUDITWHEEL_PLAT:-manylinux_${OLDEST_GLIBC/./_}_x86_64}

check=0 isolation=1 out=dist pythons=() inspect=()
while [ $# -gt 0 ]; do
  case $1 in
    --check) check=1 ;;
    --inspect) shift; inspect=("$@"); break ;;
    --out) out=$2; shift ;;
    --python) pythons+=("$2"); shift ;;
    --no-isolation) isolation=0 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) echo "build_wheel.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if [ ${#pythons[@]} -eq 0 ]; then
  if [ -n "${AUDITWHEEL_PLAT:-}" ] && [ $check -eq 0 ]; then
    for py in /opt/python/cp31[0-4]-*/bin/python; do pythons+=("$py"); done
  else
    pythons=(python3)
  fi
fi

NVCC=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
echo "architectures: $ARCHS"

check_nvcc() {  # nvcc must know each architecture's base (sm_90 for 90a-real, compute_120 for 120-virtual)
  [ -x "$NVCC" ] || { echo "build_wheel.sh: no nvcc (set CUDACXX or put nvcc on PATH)" >&2; exit 1; }
  export CUDACXX=$NVCC
  echo "nvcc: $NVCC ($("$NVCC" --version | grep -o 'release [0-9.]*'))"
  local known arch number kind base prefix
  known="$("$NVCC" --list-gpu-code) $("$NVCC" --list-gpu-arch)"
  for arch in ${ARCHS//;/ }; do
    number=${arch%%-*} kind=${arch#*-}
    base=${number%[af]}
    prefix=sm; [ "$kind" = virtual ] && prefix=compute
    grep -qw "${prefix}_$base" <<< "$known" ||
      { echo "build_wheel.sh: $NVCC cannot compile for $arch (needs CUDA 12.9 or later)" >&2; exit 1; }
  done
}
[ ${#inspect[@]} -gt 0 ] || check_nvcc

# The wheel's CMake options: every CUDA architecture, the kernels required, no
# _bench, linked to load on glibc 2.28.
CMAKE_DEFINES=(
  "CMAKE_CUDA_ARCHITECTURES=$ARCHS"
  KVSPLIT_CUDA=ON
  KVSPLIT_REQUIRE_CUDA=ON
  KVSPLIT_BENCH_KERNELS=OFF
  "KVSPLIT_OLDEST_GLIBC=$OLDEST_GLIBC"
)

if [ $check -eq 1 ]; then
  # Configure exactly as the wheel build does, without building: CMake compiles
  # its CUDA ABI probe for these architectures, so an unknown one fails here.
  py=${pythons[0]}
  pybind11_dir=$("$py" -m pybind11 --cmakedir) ||
    { echo "build_wheel.sh --check: pybind11 is not installed for $py" >&2; exit 1; }
  build=$(mktemp -d)
  trap 'rm -rf "$build"' EXIT
  args=(-S . -B "$build" -G Ninja -DSKBUILD_PROJECT_VERSION=0.0.0 -Dpybind11_DIR="$pybind11_dir"
        -DPython_EXECUTABLE="$(command -v "$py")")
  for define in "${CMAKE_DEFINES[@]}"; do args+=("-D$define"); done
  cmake "${args[@]}" > "$build/configure.log" 2>&1 ||
    { cat "$build/configure.log" >&2; echo "build_wheel.sh --check: configure failed" >&2; exit 1; }
  grep -q 'CUDA compiler identification is NVIDIA' "$build/configure.log" ||
    { echo "build_wheel.sh --check: CMake did not take $NVCC" >&2; exit 1; }
  if grep -q "_bench" "$build/build.ninja"; then
    echo "build_wheel.sh --check: the wheel configuration builds kvsplit._bench" >&2; exit 1
  fi
  grep -o "glibc $OLDEST_GLIBC stubs in .*" "$build/configure.log" ||
    { echo "build_wheel.sh --check: no glibc $OLDEST_GLIBC stubs (packaging/glibc_stubs.py)" >&2; exit 1; }
  echo "wheel configuration: ok ($(grep -c '^build .*\.cu\.o:' "$build/build.ninja") CUDA translation units)"
  exit 0
fi

find_tool() {  # a CUDA or Python tool on PATH, beside nvcc, or in a PyPI wheel's nvidia/ folder
  command -v "$1" 2>/dev/null && return
  [ -x "$(dirname "$NVCC")/$1" ] && { echo "$(dirname "$NVCC")/$1"; return; }
  for py in "${pythons[@]}" python3; do
    found=$("$py" -c "import nvidia, pathlib, sys; [print(p) for d in nvidia.__path__ for p in pathlib.Path(d).glob('*/bin/$1')]" 2>/dev/null | head -1)
    [ -n "$found" ] && { echo "$found"; return; }
  done
  return 1
}

# Checks one built wheel; prints what it finds and fails on what a wheel must not have.
inspect_wheel() {
  local wheel=$1 dir
  dir=$(mktemp -d)
  python3 -m zipfile -e "$wheel" "$dir"
  local ext
  ext=$(ls "$dir"/kvsplit/_ext.*.so)
  local bytes
  bytes=$(stat -c %s "$wheel")
  echo "--- $(basename "$wheel"): $((bytes / 1000000)) MB ($bytes bytes); _ext $(($(stat -c %s "$ext") / 1000000)) MB unpacked"
  [ "$bytes" -lt $MAX_WHEEL_BYTES ] || { echo "over PyPI's 100 MB limit" >&2; return 1; }
  if ls "$dir"/kvsplit/_bench.* >/dev/null 2>&1; then echo "the wheel holds kvsplit._bench" >&2; return 1; fi
  echo "NEEDED: $(readelf -d "$ext" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' ')"
  if readelf -d "$ext" | grep -E 'NEEDED.*(libtorch|libc10|libcudart|libpython)'; then
    echo "_ext links a library it must not (torch, c10, the CUDA runtime, libpython)" >&2; return 1
  fi
  # What sets the manylinux tag: the newest symbol version of each library.
  local newest unversioned
  newest=$(objdump -T "$ext" | grep -oE "GLIBC_[0-9.]+" | sort -uV | tail -1)
  echo "newest GLIBC symbol: $newest; GLIBCXX, CXXABI:" \
    "$(objdump -T "$ext" | grep -oE "(GLIBCXX|CXXABI)_[0-9.]+" | sort -uV | tr '\n' ' ' | grep . || echo none)"
  if [ "$(printf '%s\n' "$newest" "GLIBC_$OLDEST_GLIBC" | sort -V | tail -1)" != "GLIBC_$OLDEST_GLIBC" ] ||
     objdump -T "$ext" | grep -qE "(GLIBCXX|CXXABI)_"; then
    echo "_ext needs a symbol that glibc $OLDEST_GLIBC or its libstdc++ lacks" >&2; return 1
  fi
  unversioned=$(readelf --dyn-syms -W "$ext" |
    awk '$7 == "UND" && $5 == "GLOBAL" && $8 !~ /@/ && $8 !~ /^_?Py/ {print $8}' | tr '\n' ' ')
  if [ -n "$unversioned" ]; then
    echo "_ext needs $unversioned without a version: glibc $OLDEST_GLIBC lacks it (avoid it, or" \
      "define it in packaging/glibc_compat.cpp)" >&2; return 1
  fi
  local cuobjdump elf ptx
  if cuobjdump=$(find_tool cuobjdump); then
    elf=$("$cuobjdump" --list-elf "$ext") ptx=$("$cuobjdump" --list-ptx "$ext")
    echo "machine code (translation units per architecture):" \
      $(grep -o 'sm_[0-9]*[af]*' <<< "$elf" | sort -V | uniq -c | awk '{print $2 " x" $1}')
    echo "PTX (translation units per architecture):" \
      $(grep -o 'sm_[0-9]*[af]*' <<< "$ptx" | sort -V | uniq -c | awk '{print $2 " x" $1}')
    for arch in ${ARCHS//;/ }; do
      number=${arch%%-*}
      case $arch in
        *-virtual) grep -q "\.sm_${number}\.ptx" <<< "$ptx" ;;
        *) grep -q "\.sm_${number}\.cubin" <<< "$elf" ;;
      esac || { echo "no code for $arch in _ext" >&2; return 1; }
    done
  else
    echo "  (no cuobjdump: install the CUDA toolkit's, or PyPI's nvidia-cuda-cuobjdump, to list the architectures)"
  fi
  rm -rf "$dir"
}

if [ ${#inspect[@]} -gt 0 ]; then
  for wheel in "${inspect[@]}"; do inspect_wheel "$wheel"; done
  exit 0
fi

mkdir -p "$out"
raw=$(mktemp -d)
for py in "${pythons[@]}"; do
  echo "=== $py ($("$py" -c 'import sys; print(sys.version.split()[0])'))"
  pip_args=(wheel . --no-deps -w "$raw" -C build-dir="build/wheel-{wheel_tag}")
  [ $isolation -eq 0 ] && pip_args+=(--no-build-isolation)
  for define in "${CMAKE_DEFINES[@]}"; do pip_args+=(-C "cmake.define.$define"); done
  start=$(date +%s)
  "$py" -m pip "${pip_args[@]}"
  echo "built in $(($(date +%s) - start)) s"
done

auditwheel=()
if [ -n "${AUDITWHEEL:-}" ]; then
  auditwheel=("$AUDITWHEEL")
else
  # The building Python's own first; a command on PATH only if it runs (a pyenv shim may not).
  for py in "${pythons[@]}" python3; do
    "$py" -c "import auditwheel" 2>/dev/null && { auditwheel=("$py" -m auditwheel); break; }
  done
  if [ ${#auditwheel[@]} -eq 0 ] && found=$(find_tool auditwheel) &&
     "$found" --version >/dev/null 2>&1; then
    auditwheel=("$found")
  fi
fi
# _ext needs no library to graft into the wheel, so no patchelf either.
repair=(repair --plat "$PLAT" --only-plat)
command -v patchelf >/dev/null || repair+=(--patcher none)
tagged=$(mktemp -d)
for wheel in "$raw"/*.whl; do
  if [ ${#auditwheel[@]} -gt 0 ]; then
    "${auditwheel[@]}" show "$wheel" | tr '\n' ' ' | fold -s -w 100; echo
    "${auditwheel[@]}" "${repair[@]}" -w "$tagged" "$wheel"
  else
    echo "no auditwheel: $(basename "$wheel") keeps its linux_x86_64 tag (PyPI refuses it)"
    cp "$wheel" "$tagged/"
  fi
done
for wheel in "$tagged"/*.whl; do
  mv "$wheel" "$out/"
  echo "wheel: $out/$(basename "$wheel")"
  inspect_wheel "$out/$(basename "$wheel")"
done
rm -rf "$raw" "$tagged"
