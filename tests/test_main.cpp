// test_main.cpp — installs the tracking allocator before any test allocates, and fixes the
// intra-op thread count as the programs do; a process started as a rank runs its scenario.
#include "actmem/base/blas.h"
#include "actmem/memory/memory_tracker.h"
#include "parallel_workers.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  actmem::set_reproducible_blas();  // Note [Reproducible products] in blas.h, as the programs
  // A rank of a multi-process test (Note [Ranks are the test binary] in parallel_workers.cpp).
  if (actmem::testing::is_rank(argc, argv)) return actmem::testing::run_rank(argc, argv);
  actmem::install_memory_tracker();
  // The programs call at::set_num_threads (apply_thread_count); so do the tests. Besides
  // OpenMP's team size it sets MKL's thread count and turns MKL's dynamic mode off: in that mode,
  // MKL's default until set_num_threads is called, MKL may choose a product's threads call by
  // call, and two equal computations need not then round alike. One exactness failure seen
  // under ctest -j2 (K/LayerOffloadExactness/1_fp32, every gradient of step 2 a few ulps apart
  // with the step's loss equal) is suspected to come from there.
  at::set_num_threads(at::get_num_threads());
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
