#!/usr/bin/env bash
# run-main.sh — set up, build, and run actmem's main job (`actmem compare`) on its built-in default.
# Extra arguments are passed to the job (e.g. --log-json out.jsonl).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
exec "${ACTMEM_BUILD_DIR:-$root/build}/actmem" compare "$@"
