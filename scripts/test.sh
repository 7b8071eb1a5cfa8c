#!/usr/bin/env bash
# test.sh — set up, build, and run the whole test suite with ctest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
# shellcheck source=scripts/env.sh
source "$root/scripts/env.sh"  # the venv's ctest
ctest --test-dir "${ACTMEM_BUILD_DIR:-$root/build}" -j "$(nproc 2>/dev/null || echo 2)" --output-on-failure "$@"
