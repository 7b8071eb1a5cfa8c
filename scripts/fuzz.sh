#!/usr/bin/env bash
# fuzz.sh — build the libFuzzer targets of fuzz/ with clang, AddressSanitizer and
# UndefinedBehaviorSanitizer (build-fuzz/) and run each over its corpus.
#
#   scripts/fuzz.sh                  every target for ACTMEM_FUZZ_SECONDS seconds (default 10)
#   scripts/fuzz.sh checkpoint 600   one target for ten minutes
#
# Each run starts from the committed corpus fuzz/corpus/TARGET (files the project itself wrote,
# fuzz/make_corpus.sh) and keeps what it finds in build-fuzz/corpus/TARGET; a crash, a leak, a
# timeout or an allocation past the limits below leaves its input in build-fuzz/crashes/ and
# fails the script. Prints executions, seconds and coverage (edges) per target. libtorch is not
# instrumented; fuzz/sanitizer-options.sh says what is suppressed inside it and why. Run after
# scripts/setup.sh (CI: .ci/run, seconds per target).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/env.sh
source "$root/scripts/env.sh"
targets=(indexed_dataset checkpoint npy_cache latest jsonl argv sentencepiece_client sentencepiece_serve
         tokenizer_files piece_regex)
seconds="${ACTMEM_FUZZ_SECONDS:-10}"
if (($# > 0)); then
  targets=("$1")
  seconds="${2:-$seconds}"
fi
# shellcheck source=fuzz/configure.sh
source "$root/fuzz/configure.sh"
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)" \
  --target "${targets[@]/#/fuzz_}" actmem-sentencepiece

# shellcheck source=fuzz/sanitizer-options.sh
source "$root/fuzz/sanitizer-options.sh"
mkdir -p "$build/crashes"
printf '%-20s %12s %8s %8s %8s\n' target executions seconds edges corpus
failed=0
for t in "${targets[@]}"; do
  mkdir -p "$build/corpus/$t"
  dict=()
  [[ -f "$root/fuzz/dict/$t.dict" ]] && dict=(-dict="$root/fuzz/dict/$t.dict")
  log="$build/fuzz-$t.log"
  # Limits: 2 GiB of memory in all and 1 GiB in one allocation (a size read from a file that
  # asks for more is a finding), 30 s per input; the target's own output is closed.
  if ! "$build/fuzz/fuzz_$t" "$build/corpus/$t" "$root/fuzz/corpus/$t" "${dict[@]}" \
      -max_total_time="$seconds" -rss_limit_mb=2048 -malloc_limit_mb=1024 -timeout=30 \
      -close_fd_mask=3 -print_final_stats=1 -artifact_prefix="$build/crashes/$t-" >"$log" 2>&1; then
    failed=1
    echo "fuzz: $t failed; its input is in $build/crashes/, the log $log:" >&2
    grep -E "ERROR|SUMMARY|Test unit written|runtime error" "$log" | head -20 >&2 || tail -30 "$log" >&2
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  secs=$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log" | tail -1)
  edges=$({ grep -oE 'cov: [0-9]+' "$log" || true; } | tail -1 | cut -d' ' -f2)
  corpus=$(find "$build/corpus/$t" "$root/fuzz/corpus/$t" -type f | wc -l)
  printf '%-20s %12s %8s %8s %8s\n' "$t" "${runs:-?}" "${secs:-?}" "${edges:-?}" "$corpus"
done
if ((failed)); then exit 1; fi
echo "fuzz: every target ran clean"
