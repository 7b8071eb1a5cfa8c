#!/usr/bin/env bash
# format-check.sh — every C++ source of the tree formatted as the project's .clang-format says
# (CI: .ci/run). Debian 12's clang-format (14) is the reference: another major version formats
# some constructs differently, so it is installed from Debian's archive when missing and a
# different version is refused rather than trusted. The tests' fixtures (trees built to break a
# rule) are not checked; new files not yet added to git are. `scripts/format-check.sh --fix` formats the files in place instead.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ! command -v clang-format >/dev/null 2>&1; then
  sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  echo "format-check: installing clang-format"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends clang-format
fi
version="$(clang-format --version | sed -n 's/.*version \([0-9]*\)\..*/\1/p')"
[[ "$version" == 14 ]] || {
  echo "format-check: clang-format $version found; the tree is formatted with 14 (Debian 12's)" >&2
  exit 1
}
mapfile -t files < <(git -C "$root" ls-files --cached --others --exclude-standard '*.cpp' '*.h' | grep -v '_fixture/')
cd "$root"
if [[ "${1:-}" == "--fix" ]]; then
  clang-format -i "${files[@]}"
  exit 0
fi
if ! clang-format --dry-run --Werror "${files[@]}" 2>/tmp/format-check.$$; then
  grep -E '^[^ ].*: (error|warning):' /tmp/format-check.$$ | cut -d: -f1 | sort -u |
    sed 's/^/format-check: not formatted: /' >&2
  rm -f /tmp/format-check.$$
  echo "format-check: run scripts/format-check.sh --fix" >&2
  exit 1
fi
rm -f /tmp/format-check.$$
echo "format-check: ${#files[@]} files formatted as .clang-format says"
