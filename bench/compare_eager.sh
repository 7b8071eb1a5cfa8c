#!/usr/bin/env bash
# compare_eager.sh — bench_step (C++) against the same step in PyTorch eager on the same libtorch.
# The eager side runs in the set-up's virtual environment (scripts/env.sh): the very torch wheel
# whose libtorch the C++ build links. Runs both with the same thread count, alternating for
# ROUNDS rounds (default 3) so machine drift hits both alike, and prints per round and the median of the rounds the ratio eager / actmem per model
# (>= 1 means actmem is at least as fast). Usage: [ROUNDS=N] bench/compare_eager.sh [--iters N]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${ACTMEM_BUILD_DIR:-$root/build}"
# shellcheck source=scripts/env.sh
source "$root/scripts/env.sh"
py="$ACTMEM_PYTHON"
"$py" -c 'import torch' 2>/dev/null ||
  { echo "compare_eager: no torch in $ACTMEM_VENV: run scripts/setup.sh first" >&2; exit 1; }
threads="$(nproc)"
# actmem keeps freed memory in the heap (Note [Host malloc as a caching allocator] in
# memory_tracker.cpp); the eager side gets the same malloc settings through glibc's variables.
export MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647
tmp="$(mktemp -d)"
rounds="${ROUNDS:-3}"
for r in $(seq "$rounds"); do
  "$build/bench_step" --threads "$threads" "$@" > "$tmp/cpp.$r.json"
  "$py" "$root/bench/eager_step.py" --threads "$threads" "$@" > "$tmp/eager.$r.json"
done
"$py" - "$tmp" "$rounds" <<'PY'
import json, statistics, sys
tmp, rounds = sys.argv[1], int(sys.argv[2])
ratios, rows = {}, []
print(f"{'round':<7}{'model':<10}{'actmem ms':>12}{'eager ms':>12}{'eager/actmem':>14}")
for r in range(1, rounds + 1):
    cpp = {x["config"]: x for x in json.load(open(f"{tmp}/cpp.{r}.json"))}
    eager = {x["config"]: x for x in json.load(open(f"{tmp}/eager.{r}.json"))}
    for name in cpp:
        a, e = cpp[name]["step_time_s"], eager[name]["step_time_s"]
        ratios.setdefault(name, []).append(e / a)
        print(f"{r:<7}{name:<10}{a*1e3:>12.1f}{e*1e3:>12.1f}{e/a:>14.3f}")
for name, v in ratios.items():
    rows.append({"config": name, "eager_over_actmem_median": statistics.median(v), "rounds": v})
    print(f"median {name:<10}{'':>24}{statistics.median(v):>14.3f}")
print(json.dumps(rows))
PY
rm -rf "$tmp"
