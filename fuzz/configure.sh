# configure.sh — sourced by scripts/fuzz.sh and scripts/asan.sh: one build (build-fuzz/) with
# clang, AddressSanitizer, UndefinedBehaviorSanitizer (no recovery: the first report fails) and
# libFuzzer's coverage instrumentation, for the fuzz targets and the sanitizer test subset alike.
# Needs scripts/env.sh sourced and $root set.
build="${ACTMEM_FUZZ_BUILD_DIR:-$root/build-fuzz}"
# Debian's clang and its runtime libraries (libFuzzer, the sanitizers), installed on first use as
# scripts/setup.sh installs its packages (ACTMEM_SKIP_APT=1: never).
_fuzz_packages=(clang libclang-rt-dev)
_fuzz_missing=()
for p in "${_fuzz_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || _fuzz_missing+=("$p")
done
if ((${#_fuzz_missing[@]})) && [[ "${ACTMEM_SKIP_APT:-0}" != 1 ]]; then
  _sudo=""
  if [[ $(id -u) -ne 0 ]]; then _sudo="sudo"; fi
  echo "$0: installing ${_fuzz_missing[*]}"
  $_sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $_sudo apt-get install -y -q --no-install-recommends "${_fuzz_missing[@]}"
fi
command -v clang++ >/dev/null || { echo "$0: needs clang++ (apt-get install clang)" >&2; exit 1; }
# shellcheck disable=SC2086
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DACTMEM_SANITIZE=address,undefined \
  -DCMAKE_CXX_FLAGS="-fno-sanitize-recover=undefined" -DACTMEM_FUZZ=ON \
  -DACTMEM_BUILD_TESTS=ON -DACTMEM_BUILD_BENCH=OFF -DCMAKE_UNITY_BUILD=ON \
  $ACTMEM_TORCH_CMAKE_ARGS >/dev/null
