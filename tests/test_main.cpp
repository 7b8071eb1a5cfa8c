// test_main.cpp — installs the tracking allocator before any test allocates.
#include "actmem/blas_kernels.h"
#include "actmem/memory_tracker.h"

#include <gtest/gtest.h>

int main(int argc, char** argv) {
  actmem::maybe_run_blas_probe();  // when started as a BLAS probe child (test_blas_kernels.cpp)
  actmem::install_memory_tracker();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
