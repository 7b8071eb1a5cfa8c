# configure.sh — sourced by scripts/fuzz.sh and scripts/asan.sh: one build (build-fuzz/) with
# clang, AddressSanitizer, UndefinedBehaviorSanitizer (no recovery: the first report fails) and
# libFuzzer's coverage instrumentation, for the fuzz targets and the sanitizer test subset alike.
# Needs scripts/env.sh sourced and $root set.
build="${ACTMEM_FUZZ_BUILD_DIR:-$root/build-fuzz}"
command -v clang++ >/dev/null || { echo "$0: needs clang++ (apt-get install clang)" >&2; exit 1; }
# shellcheck disable=SC2086
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DACTMEM_SANITIZE=address,undefined \
  -DCMAKE_CXX_FLAGS="-fno-sanitize-recover=undefined" -DACTMEM_FUZZ=ON \
  -DACTMEM_BUILD_TESTS=ON -DACTMEM_BUILD_BENCH=OFF -DCMAKE_UNITY_BUILD=ON \
  $ACTMEM_TORCH_CMAKE_ARGS >/dev/null
