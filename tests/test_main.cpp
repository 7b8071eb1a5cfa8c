// test_main.cpp — installs the tracking allocator before any test allocates.
#include "actmem/memory/memory_tracker.h"

#include <gtest/gtest.h>

int main(int argc, char** argv) {
  actmem::install_memory_tracker();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
