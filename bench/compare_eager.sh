#!/usr/bin/env bash
# compare_eager.sh — bench_step (C++) against the same step in PyTorch eager on the same libtorch.
# Installs Debian's python3-torch (libtorch 1.13, like the C++ build) when it is missing, runs
# both with the same thread count and prints the ratio eager / actmem per model (>= 1 means actmem
# is at least as fast). Usage: bench/compare_eager.sh [--iters N] [--config NAME]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${ACTMEM_BUILD_DIR:-$root/build}"
py=/usr/bin/python3
if ! "$py" -c 'import torch' 2>/dev/null; then
  echo "compare_eager: installing python3-torch" >&2
  sudo=""; [[ $(id -u) -ne 0 ]] && sudo="sudo"
  $sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends python3-torch
fi
threads="$(nproc)"
# Both sides run with the same OpenMP policy (see Note [OpenMP wait policy] in process.h).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
tmp="$(mktemp -d)"
"$build/bench_step" --threads "$threads" "$@" > "$tmp/cpp.json"
"$py" "$root/bench/eager_step.py" --threads "$threads" "$@" > "$tmp/eager.json"
"$py" - "$tmp/cpp.json" "$tmp/eager.json" <<'PY'
import json, sys
cpp = {r["config"]: r for r in json.load(open(sys.argv[1]))}
eager = {r["config"]: r for r in json.load(open(sys.argv[2]))}
rows = []
print(f"{'model':<10}{'actmem ms':>12}{'eager ms':>12}{'eager/actmem':>14}")
for name in cpp:
    a, e = cpp[name]["step_time_s"], eager[name]["step_time_s"]
    rows.append({"config": name, "actmem_step_s": a, "eager_step_s": e, "eager_over_actmem": e / a})
    print(f"{name:<10}{a*1e3:>12.1f}{e*1e3:>12.1f}{e/a:>14.3f}")
print(json.dumps(rows))
PY
rm -rf "$tmp"
