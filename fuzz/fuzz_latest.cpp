// fuzz_latest.cpp — latest_checkpointed_iteration.txt through read_latest_checkpointed_iteration.
#include "actmem/train/checkpoint.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  actmem::fuzz::write_file(actmem::fuzz::scratch("latest_checkpointed_iteration.txt"), data, size);
  try {
    const auto iteration = actmem::read_latest_checkpointed_iteration(actmem::fuzz::scratch_dir());
    if (iteration && *iteration < 0) std::abort();  // the reader promises a non-negative number
  } catch (const c10::Error&) {
    // a clear refusal
  }
  return 0;
}
