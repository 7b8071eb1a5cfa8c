#!/usr/bin/env bash
# tsan.sh — build the offload tests (actmem_offload_tests: test_offload.cpp, test_moe.cpp) with
# ThreadSanitizer (build-tsan/) and run them under it.
# The offload tests run in-process with one intra-op thread; libtorch and libgomp are not
# instrumented, so multi-threaded kernels outside our code would only add false reports.
# Fails on any ThreadSanitizer report. Run after scripts/setup.sh (CI: .ci/run).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/env.sh
source "$root/scripts/env.sh"
build="$root/build-tsan"
# A unity build: each batch of sources parses libtorch's headers once (the build is most of this
# stage's time).
# shellcheck disable=SC2086
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DACTMEM_SANITIZE=thread \
  -DACTMEM_BUILD_BENCH=OFF -DCMAKE_UNITY_BUILD=ON $ACTMEM_TORCH_CMAKE_ARGS >/dev/null
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)" --target actmem_offload_tests
filter='CopyStream*:HostPool*:ActivationOffloader*:OffloadSchedule*:K/*:LayerOffload*:Modules/*:FineGrainedMemory*:FineGrained.ValidationMessages:MoEOffload*'
TSAN_OPTIONS="halt_on_error=1 exitcode=66 ${TSAN_OPTIONS:-}" OMP_NUM_THREADS=1 \
  "$build/tests/actmem_offload_tests" --gtest_filter="$filter"
echo "tsan: offload tests clean under ThreadSanitizer"
