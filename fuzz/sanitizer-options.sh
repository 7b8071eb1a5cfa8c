# sanitizer-options.sh — the AddressSanitizer, LeakSanitizer and UndefinedBehaviorSanitizer
# settings of scripts/fuzz.sh and scripts/asan.sh. Everything suppressed lies inside libtorch
# (built without the sanitizers), each with its reason:
#  - detect_container_overflow=0: container-overflow checks need every user of a std::vector
#    instrumented; vectors that libtorch (uninstrumented) grows and ours read would be reported
#    falsely.
#  - fuzz/lsan.supp: libtorch's and c10's process-lifetime singletons (operator registrations,
#    the allocator and thread-pool objects created on first use and never freed).
_fuzz_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export ASAN_OPTIONS="detect_container_overflow=0:abort_on_error=1:allocator_may_return_null=0:${ASAN_OPTIONS:-}"
export LSAN_OPTIONS="suppressions=$_fuzz_dir/lsan.supp:print_suppressions=0:${LSAN_OPTIONS:-}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:${UBSAN_OPTIONS:-}"
