#!/usr/bin/env bash
# example.sh — install actmem from build/ into a fresh prefix, build examples/ against the
# installed package (find_package(actmem), the target actmem::actmem) and run it. Run after
# scripts/setup.sh (CI: .ci/run). ACTMEM_CMAKE_ARGS is passed to the example's configure too
# (e.g. the CMAKE_PREFIX_PATH of a CUDA libtorch).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/env.sh
source "$root/scripts/env.sh"
build="${ACTMEM_BUILD_DIR:-$root/build}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
# shellcheck disable=SC2086
cmake -S "$root/examples" -B "$work/build" -G Ninja \
  "-DCMAKE_PREFIX_PATH=$work/prefix;$_actmem_torch_dir/share/cmake;$_actmem_torch_dir" \
  ${ACTMEM_CMAKE_ARGS:-} >/dev/null
cmake --build "$work/build" -j "$(nproc 2>/dev/null || echo 2)" >/dev/null
"$work/build/checkpoint_offload"
echo "example: built against the installed package and ran"
