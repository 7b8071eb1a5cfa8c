// fuzz_sentencepiece_serve.cpp — the helper's side of the SentencePiece pipe protocol: the input
// is everything actmem "asks" actmem-sentencepiece (requests, lengths, ids of any value), served
// by actmem::spm::Server with a small real model (fuzz/sentencepiece.model, made by
// fuzz/make_corpus.sh). It links libsentencepiece and no libtorch, as the helper does.
#include "sentencepiece_serve.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static actmem::spm::Server server(ACTMEM_FUZZ_SPM_MODEL);
  static std::FILE* replies = std::fopen("/dev/null", "wb");
  if (replies == nullptr) std::abort();
  if (size == 0) return 0;
  std::FILE* requests = fmemopen(const_cast<uint8_t*>(data), size, "rb");
  if (requests == nullptr) std::abort();
  const int rc = server.serve(requests, replies);
  if (rc < 0 || rc > 2) std::abort();
  std::fclose(requests);
  return 0;
}
