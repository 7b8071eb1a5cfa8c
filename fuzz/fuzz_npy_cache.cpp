// fuzz_npy_cache.cpp — GPTDataset's cached indices (the four .npy files of a cache entry whose
// description matches): a damaged or crafted entry must be rebuilt or refused, and every sample
// drawn afterwards must lie inside the dataset (Note [A cached index is checked before it is
// used] in src/data/gpt_dataset.cpp).
//
// Input: one byte choosing the file (counts, document_index, sample_index, shuffle_index), then
// that file's new contents; the entry was written by GPTDataset itself at start-up.
#include "actmem/data/gpt_dataset.h"
#include "actmem/data/indexed_dataset.h"
#include "fuzz_util.h"

#include <array>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <vector>

namespace {

const char* const kFiles[] = {"counts", "document_index", "sample_index", "shuffle_index"};

struct Entry {
  std::shared_ptr<const actmem::IndexedDataset> data;
  std::string cache;
  std::array<std::string, 4> paths;
  std::array<std::string, 4> bytes;  // each file as GPTDataset wrote it
};

// 40 documents of 13..60 uint16 tokens, as Megatron's _IndexWriter writes them.
void write_dataset(const std::string& prefix) {
  std::mt19937 rng(7);
  std::vector<int32_t> lengths;
  std::vector<int64_t> pointers, documents;
  std::ofstream bin(prefix + ".bin", std::ios::binary);
  int64_t offset = 0;
  for (int d = 0; d < 40; ++d) {
    const int32_t n = 13 + static_cast<int32_t>(rng() % 48);
    documents.push_back(d);
    lengths.push_back(n);
    pointers.push_back(offset);
    for (int32_t i = 0; i < n; ++i) {
      const uint16_t token = static_cast<uint16_t>(rng() % 1000);
      bin.write(reinterpret_cast<const char*>(&token), 2);
    }
    offset += 2 * n;
  }
  documents.push_back(40);
  std::ofstream idx(prefix + ".idx", std::ios::binary);
  const uint64_t version = 1, sequences = 40, doc_count = documents.size();
  const uint8_t code = actmem::kUInt16;
  idx.write("MMIDIDX\0\0", 9);
  idx.write(reinterpret_cast<const char*>(&version), 8);
  idx.write(reinterpret_cast<const char*>(&code), 1);
  idx.write(reinterpret_cast<const char*>(&sequences), 8);
  idx.write(reinterpret_cast<const char*>(&doc_count), 8);
  idx.write(reinterpret_cast<const char*>(lengths.data()), 4 * 40);
  idx.write(reinterpret_cast<const char*>(pointers.data()), 8 * 40);
  idx.write(reinterpret_cast<const char*>(documents.data()),
            static_cast<std::streamsize>(8 * doc_count));
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

Entry& entry() {
  static Entry e = [] {
    Entry out;
    const std::string prefix = actmem::fuzz::scratch("d");
    write_dataset(prefix);
    out.data = std::make_shared<const actmem::IndexedDataset>(prefix);
    out.cache = actmem::fuzz::scratch("cache");
    const actmem::GPTDataset built(out.data, {0, 40}, 100, 16, 7, "train", out.cache);
    (void)built;
    for (const auto& f : std::filesystem::directory_iterator(out.cache)) {
      for (size_t i = 0; i < 4; ++i) {
        if (f.path().string().find(std::string("-") + kFiles[i] + ".npy") != std::string::npos) {
          out.paths[i] = f.path().string();
          out.bytes[i] = read_all(out.paths[i]);
        }
      }
    }
    for (const auto& p : out.paths) {
      if (p.empty()) std::abort();  // GPTDataset wrote no cache entry
    }
    return out;
  }();
  return e;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  actmem::fuzz::silence_warnings();
  const Entry& e = entry();
  // fuzz/make_corpus.sh: the entry's files as seeds, each behind the byte that chooses it.
  if (const char* dir = std::getenv("ACTMEM_FUZZ_WRITE_SEEDS")) {
    for (size_t i = 0; i < 4; ++i) {
      std::ofstream(std::string(dir) + "/" + kFiles[i] + ".seed", std::ios::binary)
          << static_cast<char>(i) << e.bytes[i];
    }
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  Entry& e = entry();
  const size_t which = data[0] % 4;
  for (size_t i = 0; i < 4; ++i) {
    const std::string& bytes = e.bytes[i];
    if (i == which) {
      actmem::fuzz::write_file(e.paths[i], data + 1, size - 1);
    } else {
      actmem::fuzz::write_file(e.paths[i], reinterpret_cast<const uint8_t*>(bytes.data()),
                               bytes.size());
    }
  }
  try {
    const actmem::GPTDataset ds(e.data, {0, 40}, 100, 16, 7, "train", e.cache);
    // A crafted entry that passes the checks may order the samples otherwise (the cache is
    // trusted that far), but every sample is seq_length + 1 tokens of the dataset.
    std::vector<int64_t> tokens;
    for (int64_t i = 0; i < ds.size(); ++i) {
      tokens.clear();
      ds.sample(i, tokens);
      if (tokens.size() != 17) std::abort();
    }
  } catch (const c10::Error&) {
    // a clear refusal
  }
  return 0;
}
