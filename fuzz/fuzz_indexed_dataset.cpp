// fuzz_indexed_dataset.cpp — Megatron's MMIDIDX .idx with its .bin (IndexedDataset), then a
// GPTDataset's samples over whatever the pair holds.
//
// Input: u32 split, then the .idx's bytes (split modulo what is left, plus one) and the .bin's.
// Every sequence is read (up to a bounded number of tokens) and every sample of a small
// GPTDataset drawn; a malformed pair must throw c10::Error, nothing else.
#include "actmem/data/gpt_dataset.h"
#include "actmem/data/indexed_dataset.h"
#include "fuzz_util.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace actmem;
  if (size < 4) return 0;
  uint32_t split = 0;
  std::memcpy(&split, data, 4);
  data += 4;
  size -= 4;
  const size_t idx_size = split % (size + 1);
  const std::string prefix = fuzz::scratch("d");
  fuzz::write_file(prefix + ".idx", data, idx_size);
  fuzz::write_file(prefix + ".bin", data + idx_size, size - idx_size);
  try {
    auto ds = std::make_shared<const IndexedDataset>(prefix);
    std::vector<int64_t> tokens;
    int64_t budget = int64_t{1} << 16;  // tokens read in all
    for (int64_t i = 0; i < ds->num_sequences() && budget > 0; ++i) {
      const int64_t n = ds->sequence_length(i);
      const int64_t take = std::min(n, budget);
      tokens.clear();
      ds->read(i, n - take, take, tokens);  // the sequence's last tokens
      budget -= take + 1;
    }
    if (ds->num_sequences() > 0 && ds->num_sequences() < 4096) {
      for (int64_t d = 0; d <= ds->num_documents(); ++d) (void)ds->document_index(d);
      const GPTDataset samples(ds, {0, ds->num_sequences()}, 4, 8, 1234, "train", "");
      for (int64_t i = 0; i < samples.size(); ++i) {
        tokens.clear();
        samples.sample(i, tokens);
      }
    }
  } catch (const c10::Error&) {
    // a clear refusal
  }
  return 0;
}
