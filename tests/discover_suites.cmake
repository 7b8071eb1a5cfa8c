# discover_suites.cmake — included by ctest (the TEST_INCLUDE_FILES of tests/): lists the
# GoogleTest suites of actmem_tests and adds one ctest test per suite, which runs the suite's
# tests in one process.
#
# Why per suite and not per test (gtest_discover_tests): every process of actmem_tests first loads
# libtorch and the ~290 shared libraries Debian's build links (bound at load: BIND_NOW), ~1.5 s on
# a 2-core machine. One process per test paid that 625 times, more than half of the suite's time.
# ACTMEM_TESTS_BINARY is set by the generated file that includes this one.
if(NOT EXISTS "${ACTMEM_TESTS_BINARY}")
  add_test(actmem_tests_NOT_BUILT "${ACTMEM_TESTS_BINARY}")
  return()
endif()
execute_process(COMMAND "${ACTMEM_TESTS_BINARY}" --gtest_list_tests
                OUTPUT_VARIABLE _listing RESULT_VARIABLE _rc TIMEOUT 120)
if(NOT _rc EQUAL 0)
  # A test that fails and shows why, rather than a suite that silently ran nothing.
  add_test(actmem_tests_LISTING_FAILED "${ACTMEM_TESTS_BINARY}" --gtest_list_tests)
  return()
endif()
# Suite lines start in column 0 and end their name with a dot ("Suite." or "Prefix/Suite.");
# test lines are indented.
string(REGEX MATCHALL "(^|\n)[A-Za-z_][A-Za-z0-9_/]*\\." _suite_lines "${_listing}")
# The suites that start processes of their own (launches of 2-4 ranks, the command) run longest:
# weighted so that ctest -j starts them first instead of leaving one for the end.
set(_multi_process "^(Pipeline|CheckpointCli|CheckpointCrash|TensorParallel|DataParallel|ExpertParallel|ExpertTensorParallel|Launch|Layouts|ParallelLayout|PlanCli|GenerateCli|DataPath|Estimate)$")
foreach(_line IN LISTS _suite_lines)
  string(STRIP "${_line}" _suite)
  string(REGEX REPLACE "\\.$" "" _suite "${_suite}")
  string(REGEX MATCHALL "\n${_suite}\\.\n(  [^\n]*\n)+" _block "\n${_listing}\n")
  string(REGEX MATCHALL "\n  " _tests "${_block}")
  list(LENGTH _tests _count)
  set(_cost ${_count})
  if(_suite MATCHES "${_multi_process}")
    math(EXPR _cost "${_count} * 20")
  endif()
  add_test("${_suite}" "${ACTMEM_TESTS_BINARY}" "--gtest_filter=${_suite}.*")
  # A suite whose every test skipped (the CUDA suites without a GPU) is counted as skipped, not
  # passed; a suite with some tests skipped passes and its output lists them ("[  SKIPPED ]").
  # "0 tests passed" alone also ends a suite whose every test FAILED: only "0 passed" followed by
  # the skipped list counts as skipped (the failures of a one-test suite were reported skipped).
  # One intra-op thread per suite: ctest -j N runs N suites at once, and N processes of as many
  # OpenMP threads as cores each spin-wait for one another (on 2 cores the exactness suites ran
  # 10 to 20 times slower than alone: the whole suite took 12.7 minutes, 5.2 with one thread and
  # Note [One plain run per configuration] in exactness.h).
  # A test that needs more threads or launches workers sets its own.
  set_tests_properties("${_suite}" PROPERTIES TIMEOUT 1800 COST ${_cost}
                       ENVIRONMENT "OMP_NUM_THREADS=1"
                       SKIP_REGULAR_EXPRESSION "\\[  PASSED  \\] 0 tests\\.\n\\[  SKIPPED \\]")
endforeach()
