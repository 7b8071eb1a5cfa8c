#!/usr/bin/env bash
# asan.sh — the sanitizer subset of the tests (actmem_asan_tests, tests/CMakeLists.txt says which
# and why) built with AddressSanitizer and UndefinedBehaviorSanitizer in build-fuzz/ (the fuzz
# targets' build, fuzz/configure.sh) and run under them; the `actmem` program the tests start is
# the instrumented one. Fails on any report. Suppressions (all inside libtorch, which is not
# instrumented): fuzz/sanitizer-options.sh. Run after scripts/setup.sh (CI: .ci/run).
#   ACTMEM_ASAN_FILTER   a --gtest_filter (default: the subset without CheckpointCli, whose
#                        launches of 2 to 4 ranks are multi-process, and SilentNoOps, 30 s of
#                        whole training commands: 2.3 of the 4.3 minutes the subset takes; '*'
#                        runs them too)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/env.sh
source "$root/scripts/env.sh"
# shellcheck source=fuzz/configure.sh
source "$root/fuzz/configure.sh"
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)" \
  --target actmem_asan_tests actmem actmem-sentencepiece
# shellcheck source=fuzz/sanitizer-options.sh
source "$root/fuzz/sanitizer-options.sh"
OMP_NUM_THREADS=1 "$build/tests/actmem_asan_tests" --gtest_filter="${ACTMEM_ASAN_FILTER:--CheckpointCli.*:SilentNoOps.*}"
echo "asan: the subset ran clean under AddressSanitizer and UndefinedBehaviorSanitizer"
